"""Attention with dropout (a transformer in training: BERT's and ViT's attention dropout) is emulated: its weights
are drawn as PyTorch's CPU kernel draws them, so a run and its float64 reference drop the same ones, and its two
products (and their backward's four) are the target's attention kernel's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tf32lab


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run(q, k, v, seed: int, **options):
    torch.manual_seed(seed)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **options)
    out.pow(2).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("options", [{"dropout_p": 0.3}, {"dropout_p": 0.3, "is_causal": True},
                                     {"dropout_p": 0.3, "enable_gqa": True}], ids=["plain", "causal", "gqa"])
def test_attention_with_dropout_is_emulated_with_the_native_kernels_draws(options):
    # it ran natively ("unhandled"): a training check of BERT saw its attention at float32's own error at `high`
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 32)
    heads = 2 if options.get("enable_gqa") else 4
    k, v = torch.randn(2, heads, 16, 32), torch.randn(2, heads, 16, 32)
    native = _run(q, k, v, 1, **options)
    # plain TF32 in every product (an A100's own attention kernel is 3xTF32, within float32's noise here)
    with tf32lab.emulate("a100", math="tf32", strict=True):
        emulated = _run(q, k, v, 1, **options)
    other_draws = _run(q, k, v, 2, **options)
    for name, e, n, o in zip(("output", "q", "k", "v"), emulated, native, other_draws):
        assert _relative(o, n) > 0.1, name  # another draw drops other weights: far off
        # the same weights dropped: only TF32's rounding of the products sets them apart
        assert 1e-6 < _relative(e, n) < 1e-2, (name, _relative(e, n))


def test_dropout_of_every_weight_draws_nothing_as_pytorch():
    q = torch.randn(1, 2, 4, 8)
    torch.manual_seed(0)
    with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True):
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, dropout_p=1.0))
    assert torch.equal(torch.rand(1), after)  # the generator where PyTorch's own kernel leaves it


class _Encoder(torch.nn.Module):
    """One self-attention block with attention dropout, trained (as a BERT layer is)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0)
        return self.head(out.transpose(1, 2).flatten(2)).mean(1)


def test_a_training_check_measures_attention_with_dropout_against_the_same_draws():
    from tf32lab.report.conclusion import DRAWS_UNMATCHED

    torch.manual_seed(0)
    batches = [(torch.randn(4, 16, 32), torch.randn(4, 1)) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(_Encoder(), batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0], optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    assert not any(report.level(level).unhandled for level in ("highest", "high"))
    assert not any(DRAWS_UNMATCHED in note for note in report.notes), report.notes
    # the same weights dropped in every row as in the float64 one: float32's own drift at `highest`
    assert max(report.level("highest").deviations) < 1e-5, report.level("highest").deviations


def test_a_learnt_additive_mask_has_its_gradient_emulated():
    # a relative-position bias given as attn_mask (timm's Swin and BEiT): it ran natively in training ("unhandled")
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32)
    bias = torch.randn(4, 16, 16)

    def run():
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = bias.clone().requires_grad_()
        out = F.scaled_dot_product_attention(*qkv, attn_mask=mask)
        out.pow(2).sum().backward()
        return [out.detach(), *(t.grad for t in qkv), mask.grad]

    native = run()
    with tf32lab.emulate("a100", math="tf32", strict=True):
        emulated = run()
    for name, e, n in zip(("output", "q", "k", "v", "mask"), emulated, native):
        assert e.shape == n.shape, name
        assert 1e-6 < _relative(e, n) < 1e-2, (name, _relative(e, n))
