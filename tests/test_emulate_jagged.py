"""Jagged nested tensors (``torch.nested.nested_tensor(..., layout=torch.jagged)``, a Python tensor subclass) under
emulate(): vit-pytorch's NaViT packs images of several sizes into one, and its first ``nn.Linear`` raised
"SymIntArrayRef expected to contain only concrete integers" as the emulator tried to round the nested operand
itself. The subclass computes through its own dispatch, on its packed values: they come back as plain tensors,
and are emulated there."""

from __future__ import annotations

import pytest
import torch

import tf32lab


def _jagged(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, 64, generator=g) for n in (3, 7, 5)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def test_a_linear_on_a_jagged_nested_tensor_is_emulated_on_its_values():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = _jagged(0)
    with torch.no_grad():
        exact = [torch.nn.functional.linear(t.double(), lin.weight.double(), lin.bias.double()) for t in x.unbind()]
        with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
            y = lin(x)
    assert y.is_nested and [tuple(t.shape) for t in y.unbind()] == [(3, 32), (7, 32), (5, 32)]
    errors = [float((t.double() - e).norm() / e.norm()) for t, e in zip(y.unbind(), exact)]
    assert all(1e-5 < e < 1e-2 for e in errors), errors  # TF32-sized, not float32's 1e-7
    assert {math for (_, math) in emu.coverage} == {"tf32-rna"} and not emu.unhandled


# PyTorch's CPU math path for jagged attention builds a strided nested tensor, which warns
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_attention_on_jagged_nested_tensors_runs_natively_and_is_counted_unhandled():
    # the target's fused kernel on the packed values is not what a CPU computes (PyTorch's math path, sequence by
    # sequence): said, not emulated as a matmul
    q = _jagged(1).unflatten(-1, (4, 16)).transpose(1, 2)  # (batch, heads, jagged length, head dim)
    native = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), native.unbind()))
    assert emu.unhandled == {"aten::scaled_dot_product_attention": 1} and not emu.coverage


# -- the strided layout (torch.nested.nested_tensor's default): a C++ tensor with no sizes, no Python subclass -----
def _strided(seed: int, *shapes: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(*s, generator=g) for s in shapes])


def _linear(x: torch.Tensor) -> torch.Tensor:
    lin = torch.nn.Linear(64, 32)
    return lin(x)


def _bmm(x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, _strided(2, (64, 4), (64, 6), (64, 2)))


def _matmul(x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, _strided(2, (64, 4), (64, 6), (64, 2)))


def _attention(x: torch.Tensor) -> torch.Tensor:
    q = _strided(3, (4, 3, 16), (4, 7, 16), (4, 5, 16))
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("fn", [_linear, _bmm, _matmul, _attention], ids=["linear", "bmm", "matmul", "attention"])
def test_a_product_of_strided_nested_tensors_runs_natively_and_is_counted_unhandled(fn):
    # PyTorch runs it in the nested tensor's own kernel, on sizes no rule can read (the emulator raised
    # "NestedTensorImpl doesn't support sizes" or "dimension -2 is irregular" where PyTorch computes): said, native
    x = torch.nested.nested_tensor([torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5)])
    torch.manual_seed(0)
    native = fn(x)
    torch.manual_seed(0)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        out = fn(x)
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), native.unbind()))
    assert sum(emu.unhandled.values()) >= 1 and all(op.endswith("(nested tensor)") for op in emu.unhandled)
    assert not emu.coverage
    with pytest.raises(tf32lab.Tf32LabError), tf32lab.precision("high"), tf32lab.emulate("a100", strict=True):
        fn(x)
