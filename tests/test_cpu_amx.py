"""The ``cpu-amx`` target against what PyTorch's oneDNN does on a CPU: what ``high`` and ``medium`` give matmuls,
matrix-vector products and RNNs, emulated everywhere and, on a CPU with AMX-BF16, compared with the machine itself.

The comparisons with this machine assert only on an AMX CPU (without AMX-FP16 for ``high``); elsewhere they are
skipped, as an AVX2 or AVX-512 CPU computes its own bits (docs/gpu-results.md, the ``cpu-amx`` target)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tf32lab
from tf32lab.know import targets
from tf32lab.machine.hardware import Hardware, detect

_HERE = detect().isa
AMX = pytest.mark.skipif("amx_bf16" not in _HERE, reason="needs a CPU with AMX-BF16 (oneDNN's bf16 matmuls)")
AMX_NO_FP16 = pytest.mark.skipif("amx_bf16" not in _HERE or "amx_fp16" in _HERE,
                                 reason="needs a CPU with AMX-BF16 and without AMX-FP16 (no oneDNN TF32 there)")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max())


def test_high_is_ieee_on_the_cpu_amx_target_and_medium_bf16():
    # PyTorch asks oneDNN for TF32 only on a CPU with AMX-FP16; the target is an AMX-BF16 CPU (Sapphire Rapids)
    amx = targets.get("cpu-amx")
    for key in ("matmul", "conv", "matvec", "attention"):
        assert amx.maths_at("high", {})[key] == "ieee", key
    assert amx.maths_at("medium", {})["matmul"] == "bf16-rne"
    d = tf32lab.doctor(Hardware.simulated("cpu-amx"))
    assert d.levels["high"]["matmul"] == "ieee" and d.levels["medium"]["matvec"] == "bf16-rne"


def test_an_emulated_matrix_vector_product_is_bf16_at_medium_on_cpu_amx():
    torch.manual_seed(0)
    a, v = torch.randn(256, 1024), torch.randn(1024)
    exact = a.double() @ v.double()
    with tf32lab.precision("medium"), tf32lab.emulate("cpu-amx"):
        mv, addmv = torch.mv(a, v), torch.addmv(torch.zeros(256), a, v)
    assert _rel(mv, exact) > 1e-4 and _rel(addmv, exact) > 1e-4  # bf16 operands, not float32 noise (~1e-7)


@AMX
def test_a_matrix_vector_product_at_medium_here_is_as_the_target_says():
    torch.manual_seed(0)
    a, v = torch.randn(256, 1024), torch.randn(1024)
    exact = a.double() @ v.double()
    with tf32lab.precision("medium"):
        native = torch.mv(a, v)
        with tf32lab.emulate("cpu-amx"):
            emulated = torch.mv(a, v)
    assert _rel(native, exact) > 1e-4  # this machine rounds mv's operands to bf16 at 'medium'
    assert 0.25 < _rel(emulated, exact) / _rel(native, exact) < 4


@AMX_NO_FP16
def test_high_changes_nothing_here_and_the_probe_agrees_with_the_table():
    d = tf32lab.doctor()
    assert d.probe is not None and d.probe["high"].math == "same-as-highest"
    assert d.levels["high"]["matmul"] == "ieee"
    assert not [w for w in d.warnings if w.code == "probe-disagrees" and "'high'" in w.message]


def _rnn_errors(kind: type[nn.RNNBase], train: bool, **options: int) -> dict[str, float]:
    """The output's (and with ``train`` the input gradient's) error at 'medium', natively and emulated on cpu-amx,
    against float64."""
    torch.manual_seed(0)
    rnn = kind(64, 64, num_layers=2, batch_first=True, **options)
    x = torch.randn(4, 20, 64, requires_grad=train)
    wide = kind(64, 64, num_layers=2, batch_first=True, **options).double()
    wide.load_state_dict(rnn.state_dict())
    xd = x.detach().double().requires_grad_(train)
    out = {"exact": wide(xd)[0]}
    if train:
        out["exact-grad"] = torch.autograd.grad(out["exact"].sum(), xd)[0]
    found = {}
    for name, emulate in (("native", False), ("emulated", True)):
        with tf32lab.precision("medium"), (tf32lab.emulate("cpu-amx") if emulate else torch.enable_grad()):
            y = rnn(x)[0]
            found[name] = _rel(y.detach(), out["exact"].detach())
            if train:
                found[f"{name}-grad"] = _rel(torch.autograd.grad(y.sum(), x)[0], out["exact-grad"])
    return found


@pytest.mark.parametrize("train", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("kind,options", [(nn.GRU, {}), (nn.RNN, {}), (nn.LSTM, {"proj_size": 32})],
                         ids=["gru", "rnn", "lstm-projected"])
def test_an_rnn_without_onednns_kernel_emulated_on_a_cpu_runs_its_gemms_as_matmuls(kind, options, train):
    """On a CPU only an LSTM without projections has a oneDNN RNN kernel: a GRU's, an Elman RNN's and a projected
    LSTM's GEMMs are aten matmuls, bf16 at 'medium' on an AMX CPU (a projected LSTM 3.3e-03), where
    emulate('cpu-amx') gave float32's error (2.8e-07: the rnn key)."""
    found = _rnn_errors(kind, train, **options)
    assert found["emulated"] > 1e-4
    if train:
        assert found["emulated-grad"] > 1e-4
    if "amx_bf16" in _HERE:  # the machine itself agrees
        assert 0.25 < found["emulated"] / found["native"] < 4
        if train:
            assert 0.25 < found["emulated-grad"] / found["native-grad"] < 4


def test_an_lstm_emulated_on_cpu_amx_follows_the_rnn_cell_not_the_level():
    found = _rnn_errors(nn.LSTM, False)
    assert found["emulated"] < 1e-5  # oneDNN's LSTM kernel: mkldnn.rnn, which no level sets
    if "amx_bf16" in _HERE:
        assert found["native"] < 1e-5
