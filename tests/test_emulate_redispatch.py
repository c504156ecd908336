"""The calls emulate()'s function mode keeps itself on through (a backward, F.multi_head_attention_forward) still
reach what stands below it: a user's function mode entered outside the block and a tensor subclass's
``__torch_function__`` see them as they do without emulate(), and the mode stacks are as they were after a backward
that raised."""

from typing import ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import tf32lab

_WATCHED = ("backward", "grad", "multi_head_attention_forward")


class _Watching(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _WATCHED:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Logged(torch.Tensor):
    seen: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _WATCHED:
            cls.seen.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs)


def _attention_step(x):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    out = mha(x, x, x, need_weights=False)[0]
    out.sum().backward()
    leaf = torch.randn(3, requires_grad=True)
    torch.autograd.grad((leaf * 2).sum(), leaf)
    return out


def test_a_mode_entered_outside_the_block_sees_backward_grad_and_mha():
    x = torch.randn(2, 3, 8)
    with _Watching() as plain:
        _attention_step(x)
    with _Watching() as below, tf32lab.emulate("a100"):
        _attention_step(x)
    assert below.seen == plain.seen == ["multi_head_attention_forward", "backward", "grad"]


def test_a_tensor_subclass_sees_mha_and_backward_and_keeps_its_type():
    x = torch.randn(2, 3, 8).as_subclass(_Logged)
    _Logged.seen = []
    with tf32lab.emulate("a100"):
        out = torch.nn.MultiheadAttention(8, 2, batch_first=True)(x, x, x, need_weights=False)[0]
        (x.detach().requires_grad_() * 2).sum().backward()
    assert type(out) is _Logged
    assert _Logged.seen == ["multi_head_attention_forward", "backward"]


def test_a_backward_that_raises_leaves_the_mode_stacks_as_they_were():
    def stacks():
        return torch._C._len_torch_function_stack(), len(_get_current_dispatch_mode_stack())

    before = stacks()
    a = torch.randn(4, 8, requires_grad=True)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        inside = stacks()
        y = a @ torch.randn(8, 4)
        y.register_hook(lambda grad: 1 / 0)
        with pytest.raises(ZeroDivisionError), _Watching():
            y.sum().backward()
        assert stacks() == inside
        (a @ torch.randn(8, 4)).sum().backward()  # the block still emulates
    assert stacks() == before
    assert emu.coverage[("aten::mm", "tf32-rna")] == 3 and not emu.unhandled


def test_counting_entered_outside_the_block_keeps_the_mha_attention_the_targets():
    from tf32lab.speed.counting import Counting

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with Counting(mha, backward=True), tf32lab.emulate("a100") as emu:
        mha(x, x, x, need_weights=False)[0].sum().backward()
    ops = {op for op, _ in emu.coverage}
    assert {"tf32lab::scaled_dot_product_attention", "tf32lab::scaled_dot_product_attention_backward"} <= ops
    assert not emu.unhandled


def test_a_device_context_outside_the_block_keeps_the_mha_attention_the_targets():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with torch.device("cpu"), tf32lab.emulate("a100") as emu:
        mha(x, x, x, need_weights=False)[0].sum().backward()
    assert "tf32lab::scaled_dot_product_attention_backward" in {op for op, _ in emu.coverage}
