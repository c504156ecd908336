"""Counting, predicting and measuring speed: tf32lab.speed.counting, tf32lab.speed.prediction (predict),
tf32lab.speed.bench (bench)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cli_runner
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.know import targets as known_targets
from tf32lab.report import schema
from tf32lab.speed.counting import Counting
from tf32lab.speed.prediction import gemm_seconds, predict_counts


# -- counting ------------------------------------------------------------------------------------------------
def test_counting_gives_each_product_its_gemm_and_its_layer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 8 * 8, 10))
    x = torch.randn(4, 3, 8, 8)
    with Counting(model) as counts, torch.inference_mode():
        model(x)
    ops = {c.op: c for c in counts.ops}
    conv, linear = ops["aten::conv2d"], ops["aten::linear"]
    assert (conv.layer, conv.family, conv.gemms) == ("0", "conv", ((1, 1, 4 * 8 * 8, 16, 27),))
    assert conv.flops == 2 * (4 * 16 * 8 * 8) * 27
    assert (linear.layer, linear.gemms, linear.flops) == ("2", ((1, 1, 4, 10, 1024),), 2 * 4 * 10 * 1024)
    assert "aten::view" not in ops and "aten::flatten" not in ops  # views launch no kernel


def test_a_complex_product_counts_four_real_ones():
    # one kernel (cuBLAS's CGEMM) doing four real multiply-adds per complex one: counted as one real product was,
    # a Fourier neural operator's spectral products weighed a quarter of their work in the speed prediction
    a, b = torch.randn(3, 8, 16, dtype=torch.complex64), torch.randn(3, 16, 4, dtype=torch.complex64)
    with Counting() as counts, torch.inference_mode():
        torch.bmm(a, b)
        torch.bmm(a.real, b.real)
    complex_op, real_op = counts.ops
    assert complex_op.gemms == ((1, 3, 8, 4, 64),) and real_op.gemms == ((1, 3, 8, 4, 16),)
    assert complex_op.flops == 4 * real_op.flops


def test_counting_knows_attention_rnns_batched_products_and_gathers():
    q = torch.randn(2, 4, 16, 8)
    lstm = torch.nn.LSTM(8, 32, num_layers=2, batch_first=True)
    table = torch.randn(1000, 64)
    with Counting() as counts, torch.inference_mode():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        torch.bmm(torch.randn(3, 5, 7), torch.randn(3, 7, 2))
        lstm(torch.randn(4, 10, 8))
        torch.nn.functional.embedding(torch.tensor([1, 2, 3]), table)
    ops = {c.op: c for c in counts.ops}
    assert ops["aten::scaled_dot_product_attention"].gemms == ((1, 8, 16, 16, 8), (1, 8, 16, 8, 16))
    assert ops["aten::bmm"].gemms == ((1, 3, 5, 2, 7),)
    assert ops["aten::lstm"].gemms == ((1, 1, 40, 128, 8), (10, 1, 4, 128, 32), (1, 1, 40, 128, 32),
                                       (10, 1, 4, 128, 32))
    # a gather reads what it returns, not the whole table
    assert ops["aten::embedding"].bytes < 3 * 64 * 4 * 2 + 3 * 8 + 1
    assert not counts.uncounted


def test_an_emulated_rnn_is_counted_as_the_one_kernel_it_is_on_the_target():
    # inside emulate() the recurrence runs step by step (each GEMM rounded); the target runs one cuDNN kernel
    lstm, gru = torch.nn.LSTM(8, 32, num_layers=2, batch_first=True), torch.nn.GRU(8, 16)
    x = torch.randn(4, 10, 8)

    def counted(emulated: bool) -> list[tuple[str, tuple]]:
        block = tf32lab.emulate("a100") if emulated else contextlib.nullcontext()
        with block, Counting() as counts, torch.inference_mode():
            lstm(x)
            gru(x)
        return [(c.op, c.gemms) for c in counts.ops if c.family is not None]

    assert counted(True) == counted(False) == [
        ("aten::lstm", ((1, 1, 40, 128, 8), (10, 1, 4, 128, 32), (1, 1, 40, 128, 32), (10, 1, 4, 128, 32))),
        ("aten::gru", ((1, 1, 40, 48, 8), (4, 1, 10, 48, 16)))]


def test_an_emulated_rnns_steps_do_not_pass_the_counting_mode(monkeypatch):
    """The steps of an emulated recurrence are not counted (the RNN is one op); they also do not go through the
    counting mode at all: paused, it still cost each of an LSTM encoder's ~4600 step ops a Python dispatch."""
    from tf32lab.speed import counting

    lstm = torch.nn.LSTM(8, 32, num_layers=2, batch_first=True)
    seen = []
    monkeypatch.setattr(counting._Mode, "__torch_dispatch__", lambda self, func, types, args=(), kwargs=None: (
        seen.append(func), func(*args, **(kwargs or {})))[1])
    with tf32lab.emulate("a100"), tf32lab.precision("high"), Counting() as counts, torch.inference_mode():
        lstm(torch.randn(4, 40, 8))
    assert [c.op for c in counts.ops if c.family is not None] == ["aten::lstm"]
    assert len(seen) < 20, f"{len(seen)} ops through the counting mode"


@pytest.mark.parametrize(("kind", "gates"), [("LSTMCell", 4), ("GRUCell", 3), ("RNNCell", 1)])
def test_an_rnn_cell_is_counted_as_the_two_cublas_gemms_it_is_at_the_matmul_level(kind, gates):
    """``nn.LSTMCell`` & co. run ``aten::lstm_cell``, which PyTorch breaks down into two ``linear``s (cuBLAS, the
    matmul flag) and a fused pointwise kernel: no cuDNN. Seen whole under inference mode, it was counted as the rnn
    family by its bytes only, and a model of LSTM cells was predicted no faster at `high` ("RNNs, 97%, run at
    cuDNN's own flag") while its GEMMs ran TF32 there."""
    cell = getattr(torch.nn, kind)(256, 512)
    with Counting() as counts, torch.inference_mode():
        cell(torch.randn(64, 256))
    family = [c for c in counts.ops if c.family is not None]
    assert [(c.family, c.gemms) for c in family] == [
        ("matmul", ((1, 1, 64, gates * 512, 256), (1, 1, 64, gates * 512, 512)))]
    assert not counts.uncounted


def test_a_model_of_lstm_cells_is_predicted_faster_at_high_and_its_cells_not_called_cudnns():
    class Cells(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = torch.nn.LSTMCell(1024, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = c = torch.zeros(x.shape[1], 1024)
            for t in range(x.shape[0]):
                h, c = self.cell(x[t], (h, c))
            return h

    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(Cells(), torch.randn(4, 512, 1024), name="cells"),
                           levels=("highest", "high"))
    assert report.level("high").speedup > 1.5
    assert "rnn" not in report.speed.levels[0].shares and "RNNs" not in report.conclusion()[0]


def test_counting_with_autograd_on_sees_what_the_cpu_runs():
    lstm = torch.nn.LSTM(8, 32)
    with Counting(lstm) as counts:
        lstm(torch.randn(10, 4, 8))
    layer = next(c for c in counts.ops if c.op == "aten::mkldnn_rnn_layer")
    assert layer.family == "rnn" and layer.gemms == ((1, 1, 40, 128, 8), (10, 1, 4, 128, 32))


# -- the model ----------------------------------------------------------------------------------------------
def _mm(m: int, n: int, k: int):
    a, b = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")
    with Counting() as counts:
        torch.mm(a, b)
    return counts


def test_the_pytorch_notes_a100_gemm_is_predicted_within_25_percent():
    report = predict_counts(_mm(10240, 10240, 10240), "mm", known_targets.get("a100"))
    assert abs(report.level("highest").seconds / 0.11 - 1) <= 0.25
    assert abs(report.level("high").seconds / 0.016 - 1) <= 0.25


@pytest.mark.parametrize("target", ["v100", "t4"])
def test_targets_without_tf32_gain_nothing_by_construction(target):
    report = predict_counts(_mm(4096, 4096, 4096), "mm", known_targets.get(target))
    assert [lv.speedup for lv in report.levels] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("target", ["rtx3090", "rtx4090"])
def test_geforce_cards_get_what_their_peaks_say(target):
    # GeForce Ampere/Ada: the TF32 dense peak equals the FP32 one
    report = predict_counts(_mm(4096, 4096, 4096), "mm", known_targets.get(target))
    assert report.level("high").speedup == pytest.approx(1.0)


def test_a_large_gemm_gains_about_the_peak_ratio_and_a_skinny_one_little():
    from tf32lab.know.peaks import GEMM_FITS

    big = predict_counts(_mm(8192, 8192, 8192), "mm", known_targets.get("h100")).level("high").speedup
    fits = GEMM_FITS["h100"]
    assert 6.0 < big <= 495 / 67 * fits["tensor"].efficiency / fits["simt"].efficiency  # the peaks' ratio, fitted
    skinny = predict_counts(_mm(1, 8192, 8192), "mm", known_targets.get("h100")).level("high").speedup
    assert skinny < 1.05


def test_partial_waves_cost_a_whole_wave():
    p = known_targets.get("a100").speed_peaks()
    full = gemm_seconds((1, 1, 128 * 108, 256, 4096), "tf32-rna", p)  # 108 tiles of 128 x 256: one wave
    over = gemm_seconds((1, 1, 128 * 108 + 1, 256, 4096), "tf32-rna", p)
    # one row more: not 1 + 1/13824 times the work but a partial wave (another tile shape keeps it under 2x)
    assert over > 1.3 * full


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 5000), st.sampled_from(["ieee", "tf32-rna"]))
def test_a_gemm_never_gets_faster_when_it_grows_nor_beats_the_peak(m, n, k, math_name):
    p = known_targets.get("a100").speed_peaks()
    t = gemm_seconds((1, 1, m, n, k), math_name, p)
    assert t >= 2 * m * n * k / p.flops(math_name) - 1e-18
    for bigger in ((m + 1, n, k), (m, n + 1, k), (m, n, k + 1)):
        assert gemm_seconds((1, 1, *bigger), math_name, p) >= t * (1 - 1e-12)


def test_memory_bound_workloads_are_predicted_at_no_gain():
    mlp = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048))
    report = tf32lab.predict(tf32lab.Workload(mlp, torch.randn(1, 2048)), "a100")
    assert report.level("high").speedup <= 1.05
    pointwise = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.GELU())
    report = tf32lab.predict(tf32lab.Workload(pointwise, torch.randn(512, 512)), "a100")
    assert report.level("high").speedup == 1.0 and report.level("high").family_share == 0.0


def test_predict_reports_layers_and_leaves_everything_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).train()
    report = tf32lab.predict(tf32lab.Workload(model, torch.randn(256, 512), name="mlp"), "h100", levels=("high",))
    assert [lv.level for lv in report.levels] == ["highest", "high"]  # highest: always, the baseline
    assert [layer.name for layer in report.layers] == ["0", "2"]
    assert report.layers[0].speedup("high") > 1.5
    assert model.training
    assert json.loads(report.to_json())["kind"] == "predicted"


def test_predict_rejects_what_it_cannot_model():
    w = tf32lab.Workload(torch.nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(Tf32LabError, match="no speed model for target 'cpu-amx'"):
        tf32lab.predict(w, "cpu-amx")
    with pytest.raises(Tf32LabError, match="unknown level 'fast'"):
        tf32lab.predict(w, "a100", levels=("fast",))
    with pytest.raises(Tf32LabError, match=r"takes a tf32lab\.Workload"):
        tf32lab.predict(torch.nn.Linear(4, 4), "a100")


# -- measuring ----------------------------------------------------------------------------------------------
def test_bench_times_each_level_interleaved_with_its_spread():
    w = tf32lab.Workload(torch.nn.Linear(256, 256), torch.randn(64, 256), name="small")
    report = tf32lab.bench(w, levels=("high", "medium"), rounds=3, min_seconds=0.005)
    assert report.kind == "measured" and report.target.startswith("cpu:")
    assert [lv.level for lv in report.levels] == ["highest", "high", "medium"]
    assert report.level("highest").speedup == 1.0
    assert all(lv.seconds > 0 and lv.spread is not None and lv.spread >= 0 for lv in report.levels)
    assert all(math.isnan(lv.family_share) for lv in report.levels)
    with pytest.raises(Tf32LabError, match="rounds must be an int >= 1"):
        tf32lab.bench(w, rounds=0)


def test_a_measurement_says_which_speedups_are_noise_and_when_the_machine_was_busy():
    # a busy machine printed "0.412 ms ±3773%" and speedups of 0.70x and 0.52x on a CPU whose levels are all IEEE,
    # with nothing said
    from tf32lab.speed.bench import noise_notes
    from tf32lab.speed.prediction import LevelSpeed

    rows = [LevelSpeed("highest", 4.1e-4, 1.0, math.nan, 37.7), LevelSpeed("high", 5.9e-4, 0.70, math.nan, 0.4),
            LevelSpeed("medium", 2.0e-4, 2.05, math.nan, 0.1)]
    said = noise_notes(rows, 7)
    assert said[0].startswith("high's 0.70x is within the rounds' spread (±40%, ±3770% at highest)"), said
    assert said[1].startswith("medium's 2.05x is within the rounds' spread (±10%, ±3770% at highest)"), said
    assert said[2].startswith("the rounds spread by ±3770% at highest: the machine was busy"), said
    assert len(said) == 3, said
    steady = [LevelSpeed("highest", 1e-3, 1.0, math.nan, 0.01), LevelSpeed("medium", 0.5e-3, 2.0, math.nan, 0.01)]
    assert noise_notes(steady, 7) == []
    # one round: every spread is 0, and a 2.00x (or a 1.01x) was printed as measured, with nothing said
    assert noise_notes(steady, 1) == ["one round per level: no spread measured, so no speedup can be told from "
                                      "noise; time again with more rounds (rounds=, --rounds)"]
    assert noise_notes(steady[:1], 1) == []  # highest alone: no speedup to tell


# -- in check -------------------------------------------------------------------------------------------------
def _heavy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    return tf32lab.Workload(model, torch.randn(2048, 512), name="heavy")


def test_check_predicts_each_levels_speedup_and_the_conclusion_weighs_it():
    report = tf32lab.check(_heavy(), levels=("highest", "high", "medium"))
    high = report.level("high")
    assert high.speedup > 3 and report.level("highest").speedup == 1.0
    assert report.level("medium").speedup == high.speedup  # computed alike on a100
    assert f"predicted {high.speedup:.2f}x faster there" in report.conclusion()[0]
    data = report.to_dict()
    jsonschema.validate(data, schema())
    assert data["speed"]["kind"] == "predicted" and data["levels"][1]["speedup"] == high.speedup


def test_a_memory_bound_model_is_called_safe_but_not_worth_it():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(1, 1024), name="batch-of-one"),
                           levels=("highest", "high"))
    sentence = report.conclusion()[0]
    assert "but predicted only" in sentence and "buys little" in sentence


def test_check_without_speed_or_on_a_cpu_target_predicts_nothing():
    # a small model: nothing here depends on its size (the a100 predicts it a speedup; these predict nothing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    small = tf32lab.Workload(model, torch.randn(64, 64), name="small")
    assert tf32lab.check(small, levels=("high",)).level("high").speedup is not None
    for kwargs in ({"speed": False}, {"target": "cpu-amx"}, {"target": "native"}):
        report = tf32lab.check(small, levels=("high",), **kwargs)
        assert report.speed is None and report.level("high").speedup is None
        jsonschema.validate(report.to_dict(), schema())


# -- the command line ---------------------------------------------------------------------------------------
def cli(*args):
    return cli_runner.run(*args, module="tf32lab.cli", timeout=300)


def test_speed_command_prints_the_prediction_and_with_measure_both():
    done = cli("speed", "builtin", "--target", "h100", "--measure", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    assert "predicted (h100)" in done.stdout and "measured (cpu:" in done.stdout
    assert "layers taking the most predicted time" in done.stdout
    data = json.loads(cli("speed", "builtin", "--json", "-").stdout)
    assert data["measured"] is None and data["predicted"]["target"] == "a100"


@pytest.mark.parametrize("args, message", [
    (["--target", "cpu-amx"], "no speed model for target 'cpu-amx'"),
    (["--target", "native"], "--target native predicts nothing"),
    (["--levels", "fast"], "unknown level 'fast'"),
    (["--measure", "--rounds", "0"], "argument --rounds: bad number of rounds '0'; accepted: an int >= 1"),
    # an option of a mode not asked for is refused, as check's --steps without --train is, not silently unused
    (["--rounds", "3"], "--rounds 3 goes with --measure"),
    (["--optimizer", "sgd"], "--optimizer sgd goes with --training"),
    (["--optimizer", "none"], "--optimizer none goes with --training"),
])
def test_speed_command_bad_input_exits_2_with_one_line(args, message):
    done = cli("speed", "builtin", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_check_no_speed_leaves_the_prediction_out():
    # a workload a level is predicted for (TF32 speeds its matmuls on a100), small enough to check in a blink
    done = cli("check", "tf32lab.workloads.builtin:covariance", "--levels", "high", "--tolerance", "0.5", "--no-speed",
               "--json", "-")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["speed"] is None


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(4, 32, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(4, 32, 64))


def test_check_and_speed_count_attention_alike_and_predict_the_same_speedup():
    # check counts its run under emulate(), where attention is routed whole through tf32lab's own op
    torch.manual_seed(0)
    w = tf32lab.Workload(_Attention(), torch.randn(4, 32, 64), name="attention")
    checked, predicted = tf32lab.check(w, levels=("highest", "high"), target="h100").speed, tf32lab.predict(w, "h100")
    assert checked.flops == predicted.flops > 2 * 4 * 4 * 32 * 32 * 16 * 2
    assert checked.level("high").speedup == predicted.level("high").speedup
    assert checked.notes == predicted.notes == ()


def test_native_measure_prints_no_nan_share_and_shows_progress_only_on_a_terminal():
    import os
    import pty

    args = ("speed", "tf32lab.workloads.builtin:covariance", "--target", "native", "--measure", "--levels", "highest",
            "--rounds", "1")
    quiet = cli(*args)
    assert quiet.returncode == 0, quiet.stderr
    assert "nan" not in quiet.stdout and "measured (cpu:" in quiet.stdout
    assert "round" not in quiet.stderr  # stderr is no terminal: no bar
    main, other = pty.openpty()
    shown = []

    def read():  # as it comes: a full terminal buffer would block the child
        with contextlib.suppress(OSError):  # the child closed its end
            while chunk := os.read(main, 65536):
                shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with open(os.devnull, "w") as devnull:
            done = cli_runner.run(*args, module="tf32lab.cli", stdout=devnull, stderr=other, timeout=300,
                                  env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    finally:
        os.close(other)
    reader.join(60)
    os.close(main)
    assert done.returncode == 0
    shown = b"".join(shown)
    assert b"round 1/1 at highest" in shown or b"warm-up at highest" in shown, shown[-500:]


# -- fitted to published timings ----------------------------------------------------------------------------
def test_the_gemm_constants_are_the_fit_of_the_published_rows():
    from tf32lab.know import peaks
    from tf32lab.speed import calibration

    def shown(fits):
        return {t: {k: (round(f.efficiency, 2), round(f.wave_seconds * 1e6, 1)) for k, f in kinds.items()}
                for t, kinds in fits.items()}

    assert shown(calibration.fit()) == shown(peaks.GEMM_FITS)
    assert calibration.band() == peaks.GEMM_BAND
    fits = peaks.GEMM_FITS["a100"]
    assert fits["tensor"].efficiency < fits["simt"].efficiency  # why a large A100 GEMM gains ~6.5x, not 8x


def test_published_gemm_rows_are_predicted_within_their_median_goal():
    from tf32lab.speed import calibration, published

    off = []
    for row in published.ROWS:
        if row.kind == "gemm":
            tf32 = calibration.MATHS[row.target]
            speedup = calibration.gemm_prediction(row, "ieee") / calibration.gemm_prediction(row, tf32)
            off.append(abs(speedup / row.speedup - 1))
    assert len(off) >= 20
    assert sorted(off)[len(off) // 2] <= 0.10  # the goal: median |predicted / published - 1| <= 10%


def test_every_role_and_kind_of_a_published_row_is_known_and_sourced():
    from tf32lab.speed import published

    for row in published.ROWS:
        assert row.kind in published.KINDS and row.role in published.ROLES and row.source
        if row.seconds is not None:
            assert row.speedup == pytest.approx(row.seconds[0] / row.seconds[1])
    assert {r.role for r in published.ROWS if r.kind == "gemm"} == {"fit", "held-out"}


def test_whole_model_rows_are_held_out_and_their_speedup_is_the_throughputs_their_note_quotes():
    import re

    from tf32lab.speed import published

    whole = [row for row in published.ROWS if row.kind == "training"]
    assert len({row.label.split()[0] for row in whole}) >= 2 and {r.role for r in whole} == {"held-out"}
    for row in whole:
        assert re.match(r"[\w.-]+/[\w.-]+#\d+ \(", row.source), row.source  # an issue or PR a reader can open
        fp32, tf32 = (float(v) for v in re.match(r"([\d.]+) -> ([\d.]+) samples/s", row.note).groups())
        assert row.speedup == pytest.approx(tf32 / fp32, rel=1e-3)


def test_a_prediction_carries_a_band_around_it_and_none_where_nothing_changes():
    report = predict_counts(_mm(4096, 4096, 4096), "mm", known_targets.get("a100"))
    high = report.level("high")
    assert high.band[0] < high.speedup < high.band[1]
    assert "likely" in high.likely() and "likely" in "\n".join(report.lines())
    assert report.level("highest").band == (1.0, 1.0)
    assert json.loads(report.to_json())["levels"][1]["band"] == list(high.band)
    pointwise = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.GELU())
    flat = tf32lab.predict(tf32lab.Workload(pointwise, torch.randn(512, 512)), "a100").level("high")
    assert flat.band == (1.0, 1.0) and flat.likely() == "1.00x"


# -- convolutions by cuDNN's own flag ---------------------------------------------------------------------------
def _convnet():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3))
    return tf32lab.Workload(model, torch.randn(32, 64, 28, 28), name="convnet")


def test_the_conv_math_is_asked_by_its_own_flag_and_its_gain_has_a_wide_band():
    from tf32lab.know.peaks import CONV_BAND

    w = _convnet()
    tf32, ieee = tf32lab.predict(w, "a100", conv="tf32"), tf32lab.predict(w, "a100", conv="ieee")
    # no level touches cuDNN's flag: the levels agree with each other, the flag moves the time
    assert tf32.level("high").speedup == pytest.approx(1.0) == ieee.level("high").speedup
    gain = ieee.level("highest").seconds / tf32.level("highest").seconds
    assert gain > 2
    note = next(n for n in tf32.notes if n.startswith("convolutions at cudnn.conv tf32"))
    low, high = (float(v) for v in re.search(rf"{gain:.2f}x, likely ([0-9.]+)-([0-9.]+)x", note).groups())
    # cuDNN's per-shape choices: the band is wide (the ReLU between the convs gains nothing, so a little narrower)
    assert gain * CONV_BAND[0] <= low < gain * 0.5 and gain * 2 < high <= gain * CONV_BAND[1]
    with pytest.raises(Tf32LabError, match="unknown conv math 'fp16'; accepted: 'tf32', 'ieee'"):
        tf32lab.predict(w, "a100", conv="fp16")


# -- training steps ---------------------------------------------------------------------------------------------
def test_a_training_step_counts_backward_per_layer_and_the_optimizers_traffic():
    from tf32lab.speed.counting import Counting
    from tf32lab.speed.prediction import optimizer_ops

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    with Counting(model, backward=True) as counts:
        model(torch.randn(256, 512)).sum().backward()
    products = [(c.op, c.layer) for c in counts.ops if c.family == "matmul"]
    # forward: one addmm per layer; backward: the weight gradient of each, the input gradient of the second only
    assert sorted(products) == [("aten::addmm", "0"), ("aten::addmm", "2"), ("aten::mm", "0"), ("aten::mm", "2"),
                                ("aten::mm", "2")]
    ops = optimizer_ops(model, "adamw")
    assert sum(op.bytes for op in ops) == pytest.approx(28 * sum(p.numel() for p in model.parameters()))
    assert optimizer_ops(model, None) == []
    with pytest.raises(Tf32LabError, match="unknown optimizer 'lion'"):
        optimizer_ops(model, "lion")


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, *, x):
        return self.lin(x)


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.inner = torch.nn.Linear(64, 64), _Inner()

    def forward(self, x):
        return self.inner(x=self.a(x) @ torch.ones(64, 64))  # a product of the model's own, between its layers


def test_backward_products_count_for_their_layer_even_when_it_takes_keywords():
    from tf32lab.speed.counting import ROOT, Counting

    model = _Outer()
    with Counting(model, backward=True) as counts:
        model(torch.randn(8, 64)).sum().backward()
    products = sorted(c.layer for c in counts.ops if c.op == "aten::mm")  # the linears' forwards are addmm
    # the model's own product and its one gradient (ones needs none); inner.lin's input and weight gradients; a's
    # weight gradient (x needs none)
    assert products == sorted([ROOT, ROOT, "inner.lin", "inner.lin", "a"])


def test_predict_training_dilutes_the_gain_and_leaves_the_model_as_it_was():
    w = _heavy()
    model = w.model.eval()
    for p in model.parameters():
        p.grad = None
    forward = tf32lab.predict(w, "a100").level("high").speedup
    step = tf32lab.predict(w, "a100", training=True)
    sgd = tf32lab.predict(w, "a100", training=True, optimizer="sgd").level("high")
    assert step.step == "training" and forward > step.level("high").speedup > 1.5
    assert sgd.speedup > step.level("high").speedup  # less optimizer traffic, less dilution
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert json.loads(step.to_json())["step"] == "training"
    with pytest.raises(Tf32LabError, match="unknown optimizer 'lion'"):
        tf32lab.predict(w, "a100", training=True, optimizer="lion")
    frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    with pytest.raises(Tf32LabError, match="training=True needs an output that depends on parameters"):
        tf32lab.predict(tf32lab.Workload(frozen, torch.randn(4, 8), name="frozen"), "a100", training=True)



def test_predict_training_counts_the_backward_when_the_caller_turned_autograd_off():
    # a library's loader can leave autograd off for the whole process (silero-stress's does): a training step is
    # counted with it on, and the caller's mode is left as it was
    w = _heavy()
    on = tf32lab.predict(w, "a100", training=True).level("high").speedup
    with torch.no_grad():
        off = tf32lab.predict(w, "a100", training=True).level("high").speedup
        assert not torch.is_grad_enabled()
    assert off == on
    with torch.inference_mode():  # nor inside inference mode, where enable_grad alone records nothing
        off = tf32lab.predict(w, "a100", training=True).level("high").speedup
        assert torch.is_inference_mode_enabled()
    assert off == on

@pytest.mark.slow
def test_the_t5_base_training_row_is_predicted_within_30_percent():
    transformers = pytest.importorskip("transformers")
    from tf32lab.speed import published

    row = next(r for r in published.ROWS if r.kind == "training")
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.zeros(16, 128, dtype=torch.long, device="meta")
    w = tf32lab.Workload(model, {"input_ids": ids, "labels": ids}, name="t5-base")
    speedup = tf32lab.predict(w, "a100", ("high",), training=True).level("high").speedup
    assert abs(speedup / row.speedup - 1) <= 0.30


def test_speed_command_predicts_a_training_step_and_the_conv_flags_gain():
    done = cli("speed", "builtin", "--target", "h100", "--training", "--conv", "ieee")
    assert done.returncode == 0, done.stderr
    assert "one training step" in done.stdout and "likely" in done.stdout
    assert "convolutions at cudnn.conv tf32 instead of ieee" in done.stdout
    data = json.loads(cli("speed", "builtin", "--training", "--optimizer", "none", "--json", "-").stdout)["predicted"]
    assert data["step"] == "training" and len(data["levels"][1]["band"]) == 2
    assert data["levels"][1]["band"][0] <= data["levels"][1]["speedup"] <= data["levels"][1]["band"][1]
    for args, message in ((["--conv", "fp16"], "argument --conv: bad conv math 'fp16'; accepted: tf32, ieee"),
                          (["--optimizer", "lion"], "bad optimizer 'lion'; accepted: adamw, adam, sgd, none"),
                          (["--training", "--measure"], "--training is predicted only")):
        bad = cli("speed", "builtin", *args)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_a_model_of_small_gemms_is_told_its_gemms_are_small_not_that_they_are_few():
    # batch of one: the matmuls are nearly all of the predicted time, yet launch- and memory-bound
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(1, 1024), name="batch-of-one"),
                           levels=("highest", "high"))
    sentence = report.conclusion()[0]
    share = report.speed.level("highest").family_share
    assert share >= 0.5 and "buys little" in sentence
    assert f"matmul-family ops are {share:.0%} of its predicted time, but they are small" in sentence
    assert "only 1.0" in sentence.split("but they are small")[1]


def test_a_prediction_beside_a_measurement_fits_the_width_asked_or_comes_as_two_tables():
    from tf32lab.speed.prediction import LevelSpeed, SpeedReport

    predicted = predict_counts(_mm(4096, 4096, 4096), "mm", known_targets.get("h100"))
    measured = SpeedReport(workload="mm", target="cpu:x86_64", kind="measured", levels=tuple(
        LevelSpeed(level=lv, seconds=s, speedup=0.012 / s, family_share=math.nan, spread=0.12)
        for lv, s in (("highest", 0.012), ("high", 0.0123), ("medium", 0.0121))))
    wide = predicted.lines(measured, width=200)
    assert wide == predicted.lines(measured) and len(wide) == 4 and "measured (cpu:x86_64)" in wide[0]
    narrow = predicted.lines(measured, width=80)
    assert max(len(line) for line in narrow) <= 80
    assert narrow == [*predicted.lines(), "", *measured.lines()]
    assert "12.000 ms ±12%" in "\n".join(narrow)  # the measurement's spread stays in its own table


def test_a_measured_cpu_is_named_by_its_model_not_its_architecture():
    """``platform.processor()`` is ``x86_64`` on Linux: the measured column said ``cpu:x86_64`` on every machine."""
    from tf32lab.machine import hardware
    from tf32lab.speed import bench

    name = bench.device_name(tf32lab.Workload(torch.nn.Linear(2, 2), torch.randn(1, 2)))
    assert name == f"cpu:{bench._short(hardware.detect().cpu)}"
    assert bench._short("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == "Intel Xeon Platinum 8480+"
    assert bench._short("AMD EPYC 7B13 64-Core Processor") == "AMD EPYC 7B13 64-Core"
