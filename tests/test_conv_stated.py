"""A check of a model with convolutions or RNNs says what math they ran at each level (cuDNN's flag, which defaults
to TF32 and which no level sets) and their share of the predicted time, in text, JSON and HTML; and it explains a
speedup of about 1x by them, not by small matmuls."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch
from rich.console import Console
from torch import nn

import cli_runner
import tf32lab
from depthwise_stack import DepthwiseStack
from small_resnet import resnet
from tf32lab.report import cudnn, schema


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


# the module-scoped fixtures below are built once: the whole file runs on one xdist worker
pytestmark = pytest.mark.xdist_group("test_conv_stated")


@pytest.fixture(scope="module")
def resnet_report():
    return tf32lab.check(resnet())


def _sentence(report, start):
    return next((line for line in report.conclusion() if line.startswith(start)), None)


def test_a_resnets_convolutions_are_said_to_run_tf32_at_every_level_with_their_share(resnet_report):
    (conv,) = resnet_report.cudnn
    assert conv.family == "conv" and conv.ops == 5 and conv.flag == "tf32" and conv.asked is None
    assert conv.maths == {"highest": "tf32-rna", "high": "tf32-rna", "medium": "tf32-rna"}
    share = resnet_report.speed.level("highest").shares["conv"]
    assert conv.shares["highest"] == share and 0.3 < share < 1  # most of the predicted time: convolutions
    sentence = _sentence(resnet_report, "Convolutions ran")
    assert sentence is not None, resnet_report.conclusion()
    assert sentence.startswith("Convolutions ran TF32 at every level, `highest` included: cuDNN's own flag sets "
                               "their math, not the level (`torch.backends.cudnn.conv.fp32_precision`, PyTorch's "
                               "default 'tf32')")
    assert f"they are {share:.0%} of `highest`'s predicted time on a100" in sentence
    assert "conv='ieee' (`--conv ieee`)" in sentence


def test_the_json_names_the_conv_math_per_level_and_its_share(resnet_report):
    data = json.loads(resnet_report.to_json())
    jsonschema.validate(data, schema())
    (conv,) = data["cudnn"]
    assert conv["family"] == "conv" and conv["flag"] == "tf32" and conv["asked"] is None and conv["ops"] == 5
    assert conv["maths"] == {lv["level"]: lv["maths"]["conv"] for lv in data["levels"]}
    assert conv["shares"]["highest"] == data["speed"]["levels"][0]["shares"]["conv"] > 0.3
    assert any(line.startswith("Convolutions ran TF32 at every level") for line in data["conclusion"])
    matmul = data["speed"]["levels"][0]["shares"]["matmul"]  # the head: what the level changes
    assert 0 < matmul < conv["shares"]["highest"]


def test_the_html_shows_the_conv_math_per_level_and_the_sentence(resnet_report):
    page = resnet_report.to_html()
    assert "<h3>Convolutions and RNNs: their math is cuDNN's flag's, not the level's</h3>" in page
    share = resnet_report.cudnn[0].shares["highest"]
    assert f"<td>tf32-rna, {100 * share:.0f}% of the time</td>" in page
    assert "<code>torch.backends.cudnn.conv.fp32_precision = 'tf32'</code>" in page
    assert "Convolutions ran TF32 at every level, <code>highest</code> included" in page


def test_a_speedup_of_one_is_explained_by_the_convolutions_not_by_small_matmuls(resnet_report):
    high = resnet_report.level("high")
    assert high.passed and high.speedup < 1.05
    advice = resnet_report.conclusion()[0]
    assert "buys little" in advice
    assert "but they are small" not in advice and "launch" not in advice.split("; the rest")[0]
    shares = resnet_report.speed.level("highest").shares
    conv, matmul = shares["conv"], shares["matmul"]
    assert (f"the level changes only the matmul-family ops, {matmul:.0%} of its predicted time; convolutions, "
            f"{conv:.0%} (TF32 at every level), run at cuDNN's own flag, which no level changes") in advice


def test_an_lstms_rnn_math_and_share_are_stated():
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(Tagger().eval(), torch.randn(2, 12, 16), name="tagger"),
                           levels=("highest", "high"))
    (rnn,) = report.cudnn
    assert rnn.family == "rnn" and rnn.maths == {"highest": "tf32-rna", "high": "tf32-rna"}
    share = report.speed.level("highest").shares["rnn"]
    assert rnn.shares["highest"] == share > 0.5
    sentence = _sentence(report, "RNNs ran")
    assert sentence is not None and sentence.startswith(
        "RNNs ran TF32 at every level, `highest` included: cuDNN's own flag sets their math, not the level "
        "(`torch.backends.cudnn.rnn.fp32_precision`")
    assert f"they are {share:.0%} of `highest`'s predicted time" in sentence
    advice = report.conclusion()[0]
    assert f"RNNs, {share:.0%} (TF32 at every level), run at cuDNN's own flag" in advice
    jsonschema.validate(report.to_dict(), schema())


class PackedTagger(Tagger):
    """Tagger over sentences of other lengths, packed (what a speech or text encoder does with a padded batch)."""

    def forward(self, x):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        lengths = torch.tensor([12, 5])
        out = self.lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))[0]
        return self.head(pad_packed_sequence(out, batch_first=True)[0])


def test_a_packed_lstm_is_measured_and_stated_as_an_unpacked_one():
    # a packed sequence ran natively (IEEE float32) at every level, its steps counted as matmul-family GEMMs: a
    # normwise of 1e-7 at `high`, and "matmul-family ops are 40% of its predicted time"
    reports = []
    for cls in (Tagger, PackedTagger):
        torch.manual_seed(0)
        x = torch.randn(2, 12, 16)
        x[1, 5:] = 0.0  # the padding: the unpacked model reads it as steps of zeros
        reports.append(tf32lab.check(tf32lab.Workload(cls().eval(), x, name="tagger"), levels=("highest", "high")))
    plain, packed = reports
    assert not any("unhandled" in note for note in packed.notes), packed.notes
    (rnn,) = packed.cudnn
    assert rnn.family == "rnn" and rnn.maths == {"highest": "tf32-rna", "high": "tf32-rna"}
    assert packed.speed.level("highest").shares["rnn"] > 0.5
    for level in ("highest", "high"):
        error = packed.level(level).outputs[0].normwise
        assert error > 1e-5  # TF32's, as for the unpacked batch
        assert error < 10 * plain.level(level).outputs[0].normwise


def test_conv_ieee_and_a_target_without_tf32_are_stated_as_ieee():
    report = tf32lab.check(resnet(), levels=("highest", "high"), conv="ieee")
    (conv,) = report.cudnn
    assert conv.asked == "ieee" and conv.flag == "ieee" and set(conv.maths.values()) == {"ieee"}
    sentence = _sentence(report, "Convolutions ran")
    assert sentence.startswith("Convolutions ran IEEE float32 at every level: cuDNN's own flag sets their math, "
                               "not the level (`torch.backends.cudnn.conv.fp32_precision` = 'ieee', as "
                               "conv='ieee' set it for the check)")
    assert "--conv ieee" not in sentence  # already IEEE: nothing to switch
    v100 = tf32lab.check(resnet(), levels=("highest", "high"), target="v100")
    assert _sentence(v100, "Convolutions ran").startswith(
        "Convolutions ran IEEE float32 at every level: v100 has no TF32 for them")


def test_a_model_without_convolutions_or_rnns_says_nothing_of_them():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32)), levels=("highest", "high"))
    assert report.cudnn == () and report.to_dict()["cudnn"] == []
    assert not any("cuDNN" in line for line in report.conclusion())


def test_predicted_shares_per_family_add_up_to_the_family_share():
    report = tf32lab.predict(resnet(), "a100")
    for lv in report.levels:
        assert set(lv.shares) == {"conv", "matmul"}
        assert sum(lv.shares.values()) == pytest.approx(lv.family_share)


def test_the_text_report_states_the_conv_math(resnet_report):
    out = io.StringIO()
    resnet_report.print(Console(file=out, width=80, highlight=False))
    text = out.getvalue()
    assert "Convolutions ran TF32 at every level, `highest` included" in text
    assert f"{resnet_report.cudnn[0].shares['highest']:.0%} of `highest`'s predicted time" in text


def test_the_cli_states_the_conv_math_in_text_json_and_html(tmp_path):
    path = Path(__file__).with_name("small_resnet.py")
    done = cli_runner.run("check", f"{path}:resnet", "--levels", "highest,high", "--json", str(tmp_path / "r.json"),
                          "--html", str(tmp_path / "r.html"), module="tf32lab.cli", timeout=300,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "Convolutions ran TF32 at every level, `highest` included" in done.stdout
    assert "convolutions," in done.stdout and "but they are small" not in done.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(data, schema())
    assert data["cudnn"][0]["maths"] == {"highest": "tf32-rna", "high": "tf32-rna"}
    assert "class=\"cudnn\"" in (tmp_path / "r.html").read_text()



def test_a_policy_that_pins_a_conv_math_is_stated_beside_the_levels():
    policy = tf32lab.Policy(default="high", rules=[("stem", None, "ieee")])
    report = tf32lab.check(resnet(), levels=("highest",), policy=policy)
    (conv,) = report.cudnn
    assert conv.maths == {"highest": "tf32-rna", "policy": "mixed"} and "policy" not in conv.shares
    sentence = _sentence(report, "Convolutions ran")
    assert sentence.startswith("Convolutions ran TF32 at `highest`, TF32 or IEEE float32 by module with the policy: "
                               "cuDNN's own flag sets their math, not the level")
    assert "the policy sets it for its modules" in sentence
    jsonschema.validate(report.to_dict(), schema())


class _Recurrent(nn.Module):
    """A GRU or an LSTM and a linear head."""

    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = kind(64, 64, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM], ids=["gru", "lstm"])
def test_rnns_on_a_cpu_target_are_stated_with_onednn_and_a_gru_at_the_level(kind):
    # on a CPU a GRU runs as aten GEMMs, at the level's math (bf16 at 'medium' on cpu-amx); an LSTM runs oneDNN's
    # RNN kernel, under mkldnn.rnn, which no level sets; cuDNN's flag decides neither
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Recurrent(kind).eval(), torch.randn(4, 20, 64))
    report = tf32lab.check(workload, levels=("highest", "medium"), target="cpu-amx")
    (rnn,) = report.cudnn
    assert rnn.maths == {"highest": "ieee", "medium": "bf16-rne" if kind is nn.GRU else "ieee"}
    sentence = _sentence(report, "RNNs ran")
    assert "torch.backends.mkldnn.rnn.fp32_precision" in sentence and "cudnn" not in sentence, sentence
    native = tf32lab.check(workload, levels=("highest", "medium"), target="native")
    assert "cudnn" not in _sentence(native, "RNNs ran")  # this CPU's, whichever it is


class _Both(nn.Module):
    """An LSTM (oneDNN's kernel on a CPU) and then a GRU (aten GEMMs there)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTM(16, 16, batch_first=True), nn.GRU(16, 16, batch_first=True)

    def forward(self, x):
        return self.gru(self.lstm(x)[0])[0]


@pytest.mark.parametrize(("kind", "medium"), [(nn.GRU, "bf16-rne"), (nn.LSTM, "ieee"), (None, "ieee/bf16-rne")],
                         ids=["gru", "lstm", "both"])
def test_a_rows_rnn_math_is_the_one_its_rnns_ran_in(kind, medium):
    # the level table said `rnn ieee` at 'medium' beside a note that the GRU ran bf16 there: the row's math was the
    # rnn key's, which a CPU's GRU does not take
    torch.manual_seed(0)
    model = _Recurrent(kind).eval() if kind is not None else _Both().eval()
    x = torch.randn(4, 20, 64 if kind is not None else 16)
    report = tf32lab.check(tf32lab.Workload(model, x), levels=("highest", "medium"), target="cpu-amx", speed=False)
    assert [row.maths["rnn"] for row in report.levels] == ["ieee", medium]
    (rnn,) = report.cudnn
    assert rnn.maths == {"highest": "ieee", "medium": medium}
    if kind is None:
        assert "IEEE float32 and bf16 at `medium`" in _sentence(report, "RNNs ran")


class _Projected(nn.Module):
    """An LSTM with proj_size (aten GEMMs on a CPU, at the matmul's math) and one without (oneDNN's kernel)."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 64, proj_size=16, batch_first=True)
        self.plain = nn.LSTM(16, 16, batch_first=True) if plain else None

    def forward(self, x):
        y = self.lstm(x)[0]
        return self.plain(y)[0] if self.plain is not None else y


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize(("plain", "medium"), [(False, "bf16-rne"), (True, "ieee/bf16-rne")], ids=["alone", "both"])
def test_an_lstm_with_projections_is_stated_in_the_math_it_ran_in(plain, medium):
    # its row said `rnn ieee` at 'medium' on cpu-amx, where its GEMMs ran bf16 (error 16605 times highest's)
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_Projected(plain).eval(), torch.randn(4, 20, 64)),
                           levels=("highest", "medium"), target="cpu-amx", speed=False)
    assert [row.maths["rnn"] for row in report.levels] == ["ieee", medium]
    (rnn,) = report.cudnn
    assert rnn.maths == {"highest": "ieee", "medium": medium}


def test_a_cpu_targets_page_names_onednns_flags_not_cudnns():
    # the page said "their math is cuDNN's flag's, not the level's" beside torch.backends.cudnn.rnn.fp32_precision
    # on cpu-amx, where cuDNN computes nothing and a GRU's math is the level's (bf16 at 'medium')
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_Both().eval(), torch.randn(4, 20, 16)), levels=("highest", "medium"),
                           target="cpu-amx", speed=False)
    page = report.to_html()
    assert "cuDNN" not in page and "torch.backends.cudnn" not in page
    assert "<code>torch.backends.mkldnn.rnn.fp32_precision</code>" in page
    assert "<td>ieee/bf16-rne</td>" in page


class _GruHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(16, 16, batch_first=True), nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.gru(x)[0])


def test_a_policys_mixed_math_on_a_cpu_target_is_not_called_tf32():
    # "TF32 or IEEE float32 by module with the policy" on cpu-amx, which has no TF32: its levels mix bf16 and IEEE
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_GruHead().eval(), torch.randn(4, 20, 16)), levels=("highest", "medium"),
                           target="cpu-amx", speed=False,
                           policy=tf32lab.Policy(default="medium", rules=[("head", "highest")]))
    sentence = _sentence(report, "RNNs ran")
    assert "bf16 or IEEE float32 by module with the policy" in sentence and "TF32" not in sentence, sentence


class ConvThenLstm(nn.Module):
    """No matmul at all: a level's own share is 0, but the families' shares summed in another order left -1e-16."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2, self.lstm = nn.Conv1d(8, 24, 5), nn.Conv1d(24, 24, 3), nn.LSTM(24, 48, batch_first=True)

    def forward(self, x):
        return self.lstm(self.conv2(self.conv(x)).transpose(1, 2))[0]


def test_a_model_with_no_matmul_is_told_its_level_changes_0_percent_not_minus_0():
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(ConvThenLstm(), torch.randn(2, 8, 50), name="conv-lstm"),
                           levels=("highest", "high"))
    advice = report.conclusion()[0]
    assert "the level changes only the matmul-family ops, 0% of its predicted time" in advice, advice


class Depthwise(nn.Module):
    """A depthwise conv (NCHW) and, with ``dense``, a 1x1 conv after it: MobileNet's block."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.pw = nn.Conv2d(8, 8, 1) if dense else nn.Identity()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.pw(self.dw(x)).mean((2, 3)))


def _depthwise_report(dense: bool, accumulation: str = "ideal"):
    torch.manual_seed(0)
    return tf32lab.check(tf32lab.Workload(Depthwise(dense).eval(), torch.randn(2, 8, 16, 16)),
                         levels=("highest", "high"), speed=False, accumulation=accumulation)


# "hardware": each count's label says how its products were summed too ("ieee, ideal sum"), and the convolutions
# counted so were all taken for TF32 ones
@pytest.mark.parametrize("accumulation", ["ideal", "hardware"])
def test_a_model_whose_only_convolutions_are_depthwise_is_not_told_they_ran_tf32(accumulation):
    report = _depthwise_report(dense=False, accumulation=accumulation)
    assert {lv.level: lv.maths["conv"] for lv in report.levels} == {"highest": "ieee", "high": "ieee"}
    (said,) = cudnn.stated(report)
    assert said.startswith("Convolutions ran IEEE float32 at every level: they are depthwise"), said
    assert "TF32" not in said.split(":")[0] and "no TF32 for them" not in said, said


def test_a_model_with_depthwise_and_dense_convolutions_is_told_both_maths():
    report = _depthwise_report(dense=True)
    assert {lv.maths["conv"] for lv in report.levels} == {"tf32-rna/ieee"}
    (said,) = cudnn.stated(report)
    assert said.startswith("Convolutions ran TF32 and IEEE float32 at every level"), said
    assert "the IEEE float32 ones: they are depthwise" in said and "--conv ieee" in said, said
    out = io.StringIO()
    report.print(Console(file=out, width=120, highlight=False))
    assert "tf32/ieee" in out.getvalue()


def test_a_level_that_buys_little_for_depthwise_convolutions_says_what_runs_them():
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(DepthwiseStack().eval(), torch.randn(8, 16, 96, 96)),
                           levels=("highest", "high"))
    advice = report.conclusion()[0]
    conv = report.speed.level("highest").shares["conv"]
    assert (f"convolutions, {conv:.0%} (IEEE float32 at every level), run in PyTorch's own depthwise kernels, "
            "which no level changes") in advice, advice
    assert "cuDNN" not in advice, advice
    # with a dense conv beside them, both are named
    torch.manual_seed(0)
    mixed = tf32lab.check(tf32lab.Workload(Depthwise(dense=True).eval(), torch.randn(2, 8, 16, 16)),
                          levels=("highest", "high"))
    advice = mixed.conclusion()[0]
    assert "run at cuDNN's own flag (the depthwise convolutions in PyTorch's own kernels), which no level " \
           "changes" in advice, advice
