"""What limits each op on the GPU (tf32lab.speed.kinds): convolutions by kind, memory-bound work and the host's
cost per op, the band from the kinds a workload is made of, and predict on a model built on the meta device."""

from __future__ import annotations

import pytest
import torch

import tf32lab
from tf32lab.know import targets
from tf32lab.speed.counting import Counting
from tf32lab.speed.prediction import predict_counts, queued_seconds


def _conv_gain(conv: torch.nn.Module, x: torch.Tensor, target: str) -> tuple[float, tuple[float, float]]:
    """What cuDNN's TF32 flag buys one convolution at highest (its band too)."""
    with Counting(conv) as counts, torch.inference_mode():
        conv(x)
    t = targets.get(target)
    ieee = predict_counts(counts, "c", t, ("highest",), conv="ieee").level("highest").seconds
    tf32 = predict_counts(counts, "c", t, ("highest",), conv="tf32")
    note = next(n for n in tf32.notes if n.startswith("convolutions"))
    low, high = (float(v) for v in note.split("likely ")[1].split("x")[0].split("-")) if "likely" in note \
        else (1.0, 1.0)
    return ieee / tf32.level("highest").seconds, (low, high)


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_a_depthwise_7x7_convolution_gains_at_most_1_3x_under_tf32(target):
    # ConvNeXt's block: PyTorch runs a float32 NCHW depthwise conv on its own CUDA-core kernel (use_cudnn_depthwise)
    with torch.device("meta"):
        conv = torch.nn.Conv2d(192, 192, 7, padding=3, groups=192)
        x = torch.empty(128, 192, 56, 56)
    gain, (low, high) = _conv_gain(conv, x, target)
    assert gain <= 1.3
    assert low <= 1.0 <= high <= 2.0  # at most down to its bytes' time (cuDNN's channels-last path)


def test_convolutions_are_counted_by_their_kind():
    with torch.device("meta"):
        convs = {"conv-depthwise": torch.nn.Conv2d(32, 32, 3, groups=32), "conv-grouped": torch.nn.Conv2d(32, 32, 3,
                                                                                                        groups=4),
                 "conv": torch.nn.Conv3d(8, 16, 3, stride=2, dilation=2),
                 "conv-transposed": torch.nn.ConvTranspose2d(8, 16, 3)}
    for kind, conv in convs.items():
        x = torch.empty(2, conv.in_channels, *(12,) * (conv.weight.dim() - 2), device="meta")
        with Counting(conv) as counts, torch.inference_mode():
            conv(x)
        assert [op.kind for op in counts.ops if op.family == "conv"] == [kind]


def test_a_dense_convolution_still_gains_what_its_implicit_gemm_says():
    with torch.device("meta"):
        conv = torch.nn.Conv2d(256, 256, 3, padding=1)
        x = torch.empty(64, 256, 28, 28)
    gain, (low, high) = _conv_gain(conv, x, "a100")
    assert gain > 3 and low < gain < high


def test_memory_bound_kinds_and_the_optimizer_are_kinds_of_their_own():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.LayerNorm(32), torch.nn.Softmax(-1))
    with Counting(model, backward=True) as counts:
        model(torch.tensor([[1, 2, 3]])).sum().backward()
    kinds = {op.op: op.kind for op in counts.ops}
    assert kinds["aten::embedding"] == "embedding" and kinds["aten::native_layer_norm"] == "norm"
    assert kinds["aten::_softmax"] == "softmax" and kinds["aten::native_layer_norm_backward"] == "norm"


def test_a_host_bound_model_gains_nothing_with_the_fitted_host_cost():
    from tf32lab.know.peaks import HOST_SECONDS

    # small products: each op's host cost outlasts its kernel at both levels; the GPU's time alone says otherwise
    layers = [m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    w = tf32lab.Workload(torch.nn.Sequential(*layers), torch.randn(2048, 256))
    hosted = tf32lab.predict(w, "h100", host=HOST_SECONDS).level("high")
    alone = tf32lab.predict(w, "h100").level("high")
    assert hosted.speedup < 1.05 and hosted.band[1] < 1.1 and alone.speedup > 1.3


def test_the_queue_lets_the_gpu_run_ahead_of_the_host_only_as_a_stream_does():
    from tf32lab.speed.counting import OpCost

    ops = [OpCost("aten::mm", "x", "matmul", 0.0, 0.0, ())] * 3
    assert queued_seconds(ops, [1e-3, 1e-6, 1e-6], host=1e-5) == pytest.approx(1e-5 + 1e-3 + 2e-6)
    assert queued_seconds(ops, [1e-6] * 3, host=1e-5) == pytest.approx(3e-5 + 1e-6)


def test_a_workload_dominated_by_weak_kinds_gets_a_wide_band():
    # a depthwise-separable block (MobileNet's): the 1x1 conv gains, the depthwise one and the norms are uncertain
    with torch.device("meta"):
        block = torch.nn.Sequential(torch.nn.Conv2d(96, 96, 7, padding=3, groups=96), torch.nn.BatchNorm2d(96),
                                    torch.nn.Conv2d(96, 384, 1), torch.nn.GELU(), torch.nn.Conv2d(384, 96, 1))
        x = torch.empty(64, 96, 56, 56)
    with Counting(block) as counts, torch.inference_mode():
        block.eval()(x)
    report = predict_counts(counts, "block", targets.get("a100"), ("highest",), conv="tf32")
    note = next(n for n in report.notes if n.startswith("convolutions"))
    gain = float(note.split(": ")[1].split("x")[0])
    low, high = (float(v) for v in note.split("likely ")[1].split("x")[0].split("-"))
    assert high / low > 2 and low < gain < high
    assert "the model is weak on what this workload is made of (convolutions" in note  # said in words


def test_predict_works_on_a_model_built_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):  # no weights: a 7B-wide model's layers cost no memory
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(4, 256, dtype=torch.long, device="meta")
    report = tf32lab.predict(tf32lab.Workload(model, {"input_ids": ids}, name="llama-7b-wide"), "h100")
    high = report.level("high")
    assert high.speedup > 2 and high.band[0] < high.speedup < high.band[1]
    assert report.flops > 2 * 4 * 256 * 2 * 4096 * (4 * 4096 + 3 * 11008) * 0.9


@pytest.mark.parametrize("spectral", [torch.nn.utils.parametrizations.spectral_norm, torch.nn.utils.spectral_norm],
                         ids=["parametrizations", "legacy"])
def test_a_matrix_vector_product_is_counted_and_spectral_norm_checks(spectral):
    # spectral_norm's power iteration calls torch.mv, whose matrix is its `self` (addmv's is `mat`): the count
    # raised KeyError, and check stopped with an internal error at its first level
    torch.manual_seed(0)
    model = torch.nn.Sequential(spectral(torch.nn.Linear(8, 8)), torch.nn.Tanh())
    counting = Counting(model)
    with counting:
        torch.mv(torch.randn(6, 8), torch.randn(8))
    assert (1, 1, 6, 1, 8) in [g for op in counting.counts.ops for g in (op.gemms or ())]
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(4, 8)), levels=("highest", "high"), target="a100")
    assert report.levels[0].passed and report.levels[1].passed
