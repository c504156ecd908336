"""One emulated run hands the next, at another level, the leading convolutions and RNNs both compute alike
(tf32lab.emulation.reuse): the second run's values and counts are those it computes on its own, bit for bit."""

from __future__ import annotations

import collections
import contextlib
import os
import threading

import pytest
import torch

import tf32lab
from tf32lab.emulation.reuse import Handoff, alike
from tf32lab.know.targets import get
from tf32lab.measure.spill import SpillFile


class ConvNet(torch.nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Conv1d(3, 8, 5)
        self.b = torch.nn.Conv1d(8, 8, 3)
        self.inplace = inplace
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = y.add_(1.0) if self.inplace else y + 1.0
        y = torch.relu(y)
        y = self.b(y)
        y = torch.relu(y.add_(1.0) if self.inplace else y + 1.0)
        return self.head(y.mean(-1))


class HeadFirst(torch.nn.Module):
    """A matmul before the convolution: the levels part at once, and nothing is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.conv = torch.nn.Conv1d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.lin(x))


def _run(model: torch.nn.Module, x: torch.Tensor, level: str, handoff: Handoff | None = None):
    with tf32lab.emulate("a100", handoff=handoff) as emu, tf32lab.precision(level), torch.inference_mode():
        out = model(x)
    return out, dict(emu.coverage), dict(emu.unhandled)


def _handoff() -> Handoff:
    return Handoff(alike(get("a100"), "highest", "high", tf32lab.emulation.emulator.context_cells()))


def _handed(model: torch.nn.Module, x: torch.Tensor):
    """``model`` at `high` alone, and at `high` after a `highest` run that recorded for it: (the hand-off, what
    the first run kept, the run alone, the run that replayed)."""
    alone = _run(model, x, "high")
    handoff = _handoff()
    handoff.record()
    _run(model, x, "highest", handoff)
    kept = len(handoff.kept)
    handoff.replay()
    return handoff, kept, alone, _run(model, x, "high", handoff)


@pytest.mark.parametrize("inplace", [False, True])
def test_the_second_run_takes_the_convolutions_and_gets_its_own_bits(inplace: bool) -> None:
    torch.manual_seed(0)
    model, x = ConvNet(inplace), torch.randn(4, 3, 40)
    alone = _run(model, x, "high")
    handoff = _handoff()
    handoff.record()
    first = _run(model, x, "highest", handoff)
    assert len(handoff.kept) == 2  # both convolutions; the Linear ends what is kept
    handoff.replay()
    second = _run(model, x, "high", handoff)
    assert handoff.taken == 2
    # add_ wrote into the first run's conv outputs: what was kept is a copy
    assert torch.equal(second[0], alone[0]) and second[1:] == alone[1:]
    assert not torch.equal(first[0], second[0])  # the Linear differs between the levels: the runs do
    assert not handoff.kept  # handed over, nothing left held


@pytest.mark.parametrize("inplace", [False, True])
def test_with_a_spill_file_the_kept_results_are_written_out_and_come_back_bit_for_bit(inplace: bool) -> None:
    # held in memory, a conv net's first activation stayed alive across the whole first row (torchcrepe's: 64 MiB
    # over the check's reference peak); written out, the first run holds nothing of it
    torch.manual_seed(0)
    model, x = ConvNet(inplace), torch.randn(4, 3, 40)
    alone = _run(model, x, "high")
    with SpillFile(min_bytes=4 * 8 * 36 * 4) as spill:  # the first conv's output, not the smaller second's
        handoff = Handoff(_handoff().alike, spill=spill)
        handoff.record()
        _run(model, x, "highest", handoff)
        assert len(handoff.kept) == 2 and spill.written == 4 * 8 * 36 * 4
        first, second = (kept.result[1][0] for kept in handoff.kept)
        assert not isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)  # only the first written
        handoff.replay()
        replayed = _run(model, x, "high", handoff)
    assert handoff.taken == 2 and torch.equal(replayed[0], alone[0]) and replayed[1:] == alone[1:]


def test_a_matmul_first_keeps_nothing() -> None:
    torch.manual_seed(0)
    handoff, kept, alone, second = _handed(HeadFirst(), torch.randn(2, 3, 16))
    assert kept == 0 and handoff.taken == 0 and torch.equal(second[0], alone[0])


def test_a_call_that_is_not_the_one_kept_is_computed_and_ends_the_handoff() -> None:
    torch.manual_seed(0)
    model = ConvNet()
    handoff = _handoff()
    handoff.record()
    _run(model, torch.randn(4, 3, 40), "highest", handoff)
    handoff.replay()
    other = torch.randn(4, 3, 41)  # another shape: not the run that kept
    out = _run(model, other, "high", handoff)
    assert handoff.taken == 0 and handoff.state is None and not handoff.kept
    assert torch.equal(out[0], _run(model, other, "high")[0])


def test_nothing_past_the_budget_is_kept() -> None:
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(4, 3, 40)
    handoff = Handoff(frozenset({"conv"}), budget=4 * 8 * 36 * 4)  # the first conv's output, not the second's
    handoff.record()
    _run(model, x, "highest", handoff)
    assert len(handoff.kept) == 1 and handoff.bytes == 4 * 8 * 36 * 4


def test_another_threads_ops_are_neither_kept_nor_taken() -> None:
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(4, 3, 40)
    handoff = _handoff()
    handoff.record()
    done = []
    thread = threading.Thread(target=lambda: done.append(_run(model, x, "highest", handoff)))
    thread.start()
    thread.join()
    assert done and not handoff.kept


def test_alike_families_follow_the_target_table() -> None:
    cells = {"cuda.conv": "tf32", "cuda.rnn": "tf32", "sdpa": "math", "mkldnn.matmul": "ieee"}
    assert {"conv", "rnn"} <= alike(get("a100"), "highest", "high", cells)
    assert "matmul" not in alike(get("a100"), "highest", "high", cells)
    off = {**cells, "cuda.conv": "ieee"}
    assert "conv" in alike(get("a100"), "highest", "high", off)  # IEEE at both: alike too
    # a CPU target's GRU runs aten GEMMs, which `medium` rounds to bf16: not alike there
    assert "rnn" not in alike(get("cpu-amx"), "highest", "medium", cells)


def _lstm() -> tf32lab.Workload:
    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(6, 16, 2, batch_first=True)
            self.conv = torch.nn.Conv1d(16, 16, 3)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.lstm(x)
            y = self.conv(y.transpose(1, 2) + 0.01 * torch.randn(1))  # a draw between the kept ops
            return self.head(y.mean(-1))

    torch.manual_seed(0)
    return tf32lab.Workload(Encoder(), torch.randn(3, 20, 6), name="encoder")


@pytest.mark.parametrize(("target", "levels"), [("a100", ("highest", "high")), ("h100", ("high", "highest")),
                                               ("cpu-amx", ("highest", "medium"))])
def test_check_rows_are_what_each_level_gives_measured_alone(target: str, levels: tuple[str, str]) -> None:
    workload = _lstm()
    both = tf32lab.check(workload, levels=levels, target=target, speed=False)
    alone = tf32lab.check(workload, levels=levels[1:], target=target, speed=False)
    high, solo = both.levels[1], alone.levels[0]
    assert high.outputs == solo.outputs and high.coverage == solo.coverage
    assert [(e.name, e.introduced, e.accumulated) for e in high.layers] == \
        [(e.name, e.introduced, e.accumulated) for e in solo.layers]


def test_check_hands_the_lstm_and_conv_to_the_second_row(monkeypatch) -> None:
    taken = []
    close = Handoff.close

    def closing(self: Handoff) -> None:
        taken.append(self.taken)
        close(self)

    monkeypatch.setattr(Handoff, "close", closing)
    tf32lab.check(_lstm(), levels=("highest", "high"), speed=False)
    assert max(taken) == 2  # aten::lstm and the convolution, not the Linear after them


class _McDropout(torch.nn.Module):
    """Monte Carlo dropout: an LSTM's dropout between its layers, and one after it, on at inference."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 8, 2, dropout=0.5, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lstm.train()
        y, _ = self.lstm(x)
        return self.head(torch.nn.functional.dropout(y[:, -1], 0.5, training=True))


def test_an_rnn_that_draws_is_not_handed_over() -> None:
    # taken, the LSTM would not draw its dropout masks: the dropout after it would draw other ones
    torch.manual_seed(0)
    workload = tf32lab.Workload(_McDropout(), torch.randn(3, 6, 4), name="mc-dropout")
    both = tf32lab.check(workload, levels=("highest", "high"), speed=False).levels[1]
    alone = tf32lab.check(workload, levels=("high",), speed=False).levels[0]
    assert both.outputs == alone.outputs and both.passed == alone.passed


def test_nothing_is_kept_for_a_level_whose_layers_only_are_rerun(monkeypatch) -> None:
    # the policy's level is measured layer by layer, never run end to end: what was kept for it was held to the end
    recorded = []
    record = Handoff.record

    def recording(self: Handoff) -> None:
        recorded.append(self)
        record(self)

    monkeypatch.setattr(Handoff, "record", recording)
    torch.manual_seed(0)
    workload = tf32lab.Workload(ConvNet(), torch.randn(4, 3, 40), name="convnet")
    report = tf32lab.check(workload, levels=("highest",), policy=tf32lab.Policy(default="high"), speed=False)
    assert [row.level for row in report.levels] == ["highest", "policy"] and not recorded


class _Cells(torch.nn.Module):
    """An RNN cell run step by step: aten::lstm_cell breaks down into aten::linear, whose GEMMs a GPU computes at the
    matmul level, not cuDNN's RNN flag (the matmul family in the op table)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.cell = getattr(torch.nn, kind)(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = None
        for t in range(x.size(1)):
            h = self.cell(x[:, t], h)
        return h[0] if isinstance(h, tuple) else h


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell"])
def test_an_op_that_breaks_down_into_ops_the_levels_compute_apart_is_not_handed_over(kind: str) -> None:
    torch.manual_seed(0)
    handoff, _, alone, second = _handed(_Cells(kind), torch.randn(3, 5, 6))
    assert torch.equal(second[0], alone[0]) and second[1:] == alone[1:] and handoff.taken == 0


class _Mixer(torch.nn.Module):
    """A convolution, then in float32 a channel-mixing matmul (a fast path), at any other dtype the same sum written
    out: the float64 reference sees a convolution only, a rerun in float32 a matmul too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 6, 3) / 4)
        self.mix = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.conv1d(x, self.w).transpose(1, 2)
        if y.dtype == torch.float32:
            return y @ self.mix
        return (y.unsqueeze(-1) * self.mix).sum(-2)


def test_a_layer_is_rerun_where_its_rerun_met_a_family_the_levels_compute_apart(reruns: list[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(6, 6, 1), torch.nn.Conv1d(6, 6, 1), _Mixer())
    workload = tf32lab.Workload(model, torch.randn(3, 6, 20), name="mixer")
    both = tf32lab.check(workload, introduced="all", levels=("highest", "high"), speed=False).levels[1]
    assert sorted(reruns) == ["1", "2", "2"]  # the second convolution once for both levels, the mixer at each
    alone = tf32lab.check(workload, introduced="all", levels=("high",), speed=False).levels[0]
    assert {e.name: e.introduced for e in both.layers} == {e.name: e.introduced for e in alone.layers}


class _Nested(torch.nn.Module):
    """The model's own emulate() block between two convolutions: its Linear runs at the level in force, unseen by the
    block around the model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Conv1d(6, 6, 3), torch.nn.Conv1d(6, 6, 3)
        self.lin = torch.nn.Linear(18, 18)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        with tf32lab.emulate("a100"):
            y = self.lin(y)
        return self.b(y)


def test_an_emulate_block_inside_the_model_ends_the_handoff() -> None:
    torch.manual_seed(0)
    _, kept, alone, second = _handed(_Nested(), torch.randn(3, 6, 20))
    assert kept == 1  # the first convolution, not the one after the block
    assert torch.equal(second[0], alone[0]) and second[1:] == alone[1:]


class _Saliency(torch.nn.Module):
    """The gradient of an LSTM's output with respect to its input, taken inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 8, 1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False), torch.enable_grad():
            x = x.clone().requires_grad_()
            y, _ = self.lstm(x)
            return torch.autograd.grad(y.square().sum(), x)[0]


def test_a_result_in_an_autograd_graph_is_not_handed_over() -> None:
    # taken, the LSTM's output would hang from the first run's graph, not from this run's input
    torch.manual_seed(0)
    _, kept, alone, second = _handed(_Saliency(), torch.randn(3, 5, 6))
    assert kept == 0
    assert torch.equal(second[0], alone[0]) and second[1:] == alone[1:]


def test_a_result_on_a_device_is_not_kept() -> None:
    # a device's memory is the model's: a copy kept there could leave the next run short of it
    handoff = Handoff(frozenset({"conv"}))
    handoff.record()
    handoff.run("aten::convolution", "conv", (), {}, collections.Counter(), collections.Counter(),
                lambda: torch.empty(4, device="meta"))
    assert not handoff.kept and handoff.state is None
    handoff.record()
    handoff.run("aten::convolution", "conv", (), {}, collections.Counter(), collections.Counter(),
                lambda: torch.zeros(4))
    assert len(handoff.kept) == 1


class _Recurrent(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(6, 16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, h = self.rnn(x)
        return (y, *(h if isinstance(h, tuple) else (h,)))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_result_written_out_comes_back_with_the_strides_it_had(kind: str) -> None:
    # batch-first, one sequence: the output is (1, T, H) transposed from (T, 1, H), contiguous but with the strides
    # of its size-1 dimension its own (H, not T*H); read back as a plain view, it had another stride there than the
    # same run alone
    torch.manual_seed(0)
    model, x = _Recurrent(kind), torch.randn(1, 20, 6)
    alone = _run(model, x, "high")[0]
    with SpillFile(min_bytes=1) as spill:
        handoff = Handoff(_handoff().alike, spill=spill)
        handoff.record()
        _run(model, x, "highest", handoff)
        handoff.replay()
        replayed = _run(model, x, "high", handoff)[0]
        assert handoff.taken == 1 and spill.written > 0
    assert [t.stride() for t in replayed] == [t.stride() for t in alone]
    assert all(torch.equal(a, b) for a, b in zip(replayed, alone))


_CALLS = [0]


class _CountsItsCalls(torch.nn.Module):
    """Python state outside the model (a module-level counter, which no reset puts back) that scales the input
    before the first convolution: its input differs between the rows, in the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS[0] += 1
        return self.conv(x * _CALLS[0])


def test_a_convolution_fed_other_values_at_the_next_level_is_computed_not_taken() -> None:
    torch.manual_seed(0)
    model, x = _CountsItsCalls(), torch.randn(2, 3, 16)
    _CALLS[0] = 1
    alone = _run(model, x, "high")  # as the second call
    _CALLS[0] = 0
    handoff = _handoff()
    handoff.record()
    _run(model, x, "highest", handoff)
    assert len(handoff.kept) == 1
    handoff.replay()
    second = _run(model, x, "high", handoff)
    assert handoff.taken == 0  # the shapes alike, the bits not
    assert torch.equal(second[0], alone[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from Linux's /proc")
def test_the_digest_of_a_large_input_makes_no_copy_of_it() -> None:
    # an integer sum makes an int64 copy of what it sums: whole, a conv net's 48 MiB input made 96 MiB at the
    # check's peak; a chunk at a time, a few MiB (measured in a fresh process, whose peak is this one's alone)
    import subprocess
    import sys

    code = ("import torch\nfrom tf32lab.emulation.reuse import _digest\n"
            "def peak():\n"
            "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
            "x = torch.randn(16 << 20)\nbefore = peak()\n_digest(x)\n_digest(x.view(4096, -1).t())\n"
            "print((peak() - before) >> 10)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(done.stdout.strip()) < 16, done.stdout  # MiB, of a 64 MiB tensor


class _Attend(torch.nn.Module):
    """Attention over its own projections: on an A100 the efficient kernel is 3xTF32 at `highest` and `high`
    alike, and the math kernel's GEMMs are TF32 at `high` only."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize(("kernel", "times"), [("efficient", 1), ("math", 2)])
def test_an_attention_the_levels_compute_alike_is_rerun_once_for_both(reruns: list[str], kernel: str,
                                                                       times: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    workload = tf32lab.Workload(_Attend(), torch.randn(3, 10, 16), name="attend")
    # PyTorch's own choice (the float64 reference's CPU flash kernel), or the math kernel alone (its GEMMs)
    with sdpa_kernel([SDPBackend.MATH]) if kernel == "math" else contextlib.nullcontext():
        both = tf32lab.check(workload, introduced="all", levels=("highest", "high"), speed=False).levels[1]
        # the projection is fed the model's inputs: the end-to-end run measures it; the attention is rerun
        assert reruns == ["(model)"] * times
        alone = tf32lab.check(workload, introduced="all", levels=("high",), speed=False).levels[0]
    assert both.maths["attention"] == ("tf32x3" if kernel == "efficient" else "tf32-rna")
    assert [(e.name, e.introduced, e.accumulated) for e in both.layers] == \
        [(e.name, e.introduced, e.accumulated) for e in alone.layers]


class _NoCudnn(torch.nn.Module):
    """A convolution with cuDNN off inside the layer (PyTorch's own kernel: its GEMMs at the matmul level)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, 3) / 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.backends.cudnn.flags(enabled=False):
            return torch.nn.functional.conv1d(x, self.weight, padding=1)


def test_a_convolution_with_cudnn_off_is_computed_at_each_level_not_reused() -> None:
    # cuDNN's flag leaves a convolution alike at highest and high on an A100; with cuDNN off it is a GEMM at the
    # matmul's level: neither the layer's rerun nor the row's convolution may be the other level's
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(8, 8, 3, padding=1), torch.nn.Tanh(), _NoCudnn(), torch.nn.Tanh(),
                                torch.nn.Conv1d(8, 8, 3, padding=1))
    workload = tf32lab.Workload(model, torch.randn(2, 8, 64), name="no-cudnn")
    both = tf32lab.check(workload, levels=("highest", "high"), speed=False).levels[1]
    alone = tf32lab.check(workload, levels=("high",), speed=False).levels[0]
    assert both.outputs == alone.outputs and both.coverage == alone.coverage
    assert [(e.name, e.introduced) for e in both.layers] == [(e.name, e.introduced) for e in alone.layers]
