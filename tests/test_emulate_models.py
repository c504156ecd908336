"""Whole models under emulate(): zero unhandled ops, a visible effect, and IEEE emulation equal to native."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tf32lab


def _models():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2,
                                    enable_nested_tensor=False).eval()
    prenorm = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, norm_first=True, activation="gelu").eval()
    mha = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.ReLU(),
                        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Flatten(), nn.LazyLinear(10))
    x_seq, x_img = torch.randn(4, 12, 64), torch.randn(2, 3, 16, 16)
    cnn(x_img)  # materialise the lazy layer
    return {
        "transformer encoder": (encoder, x_seq),
        "pre-norm encoder layer": (prenorm, x_seq),
        "multi-head attention": (lambda x: mha(x, x, x)[0], x_seq),
        "lstm": (nn.LSTM(64, 32, num_layers=2, bidirectional=True, batch_first=True), x_seq),
        "gru": (nn.GRU(64, 32, batch_first=True), x_seq),
        "rnn": (nn.RNN(64, 32, nonlinearity="relu", batch_first=True), x_seq),
        "cnn": (cnn, x_img),
    }


MODELS = _models()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
@pytest.mark.parametrize("name", list(MODELS))
def test_models_are_fully_emulated(name, mode):
    model, x = MODELS[name]
    grad_mode = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    with grad_mode():
        native = _first(model(x))
        with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True) as emu:
            out = _first(model(x))
        with tf32lab.emulate("a100", math="ieee", strict=True):
            ieee = _first(model(x))
    assert not emu.unhandled and emu.coverage
    assert (out - native).abs().max() > 0, "TF32 emulation changed nothing"
    # the rules re-express fused kernels step by step: in IEEE they must give the native result
    assert torch.allclose(ieee, native, rtol=1e-5, atol=1e-5), (ieee - native).abs().max()


def test_rnn_family_follows_cudnns_flag_not_the_matmul_flag():
    """At 'highest' an a100 still runs LSTMs in TF32: cuDNN's RNN flag defaults to tf32."""
    model, x = MODELS["lstm"]
    with torch.no_grad(), tf32lab.emulate("a100") as emu:
        out = _first(model(x))
    assert {m for _, m in emu.coverage} == {"tf32-rna"}
    assert (out - _first(model(x))).abs().max() > 0


@pytest.mark.slow
def test_minilm_embeddings_under_tf32():
    from tf32lab.workloads import samples

    model = samples.minilm()
    sentences = list(samples.SENTENCES)
    native = model.encode(sentences, convert_to_tensor=True, batch_size=64)
    with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True) as emu:
        emulated = model.encode(sentences, convert_to_tensor=True, batch_size=64)
    assert not emu.unhandled
    assert sum(n for (op, _), n in emu.coverage.items() if "linear" in op) == 37  # 6 layers x 6, and BERT's pooler
    assert (emulated - native).abs().max() > 0
    cosine = torch.nn.functional.cosine_similarity(emulated, native, dim=-1)
    assert (1 - cosine).max() <= 1e-5, (1 - cosine).max()
