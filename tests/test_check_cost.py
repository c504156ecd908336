"""What check's own arithmetic costs: its comparisons and layer reruns run outside the modes of the runs they sit
in (the float64 reference's, the emulator's), with the same bits as through them; and what its modes do per op of
the model stays constant (no sweep of every kept op, no op-table lookup per op), for a decoder runs many small ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tf32lab
from tf32lab.measure import layers, reference
from tf32lab.measure.norms import scratch, tree_normwise
from tf32lab.numbers import metrics


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_comparison_passes_no_mode_and_keeps_its_bits():
    torch.manual_seed(0)
    ys = {"a": torch.randn(300_000), "b": torch.randn(7, 5)}  # several chunks, then a second output summed on
    refs = {k: v.double() + 1e-3 * torch.randn(v.shape, dtype=torch.float64) for k, v in ys.items()}
    norms = {k: float(torch.linalg.vector_norm(r)) ** 2 for k, r in refs.items()}
    work = scratch(torch.device("cpu"))
    plain = tree_normwise(ys, refs, norms, work)
    seen = _Seen()
    with seen:
        inside = tree_normwise(ys, refs, norms, work)
    assert seen.ops == 0
    assert inside == plain
    assert 1e-4 < plain[0] < 1e-2


class _Sized(TorchDispatchMode):
    """The new tensors of ``n`` elements that ops make (not views, not writes into an operand)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.made = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.n and not func.is_view \
                and not func._schema.is_mutable:
            self.made.append(func.overloadpacket.__name__)
        return out


def test_an_output_compare_forms_its_difference_once_and_keeps_its_numbers():
    # each output-sized buffer of a large output (logits) is fresh pages to fault in: the compare made 22, 3 of
    # them y - r formed again, and 5 for the histogram's steps
    torch.manual_seed(0)
    r = torch.randn(64, 500, dtype=torch.float64)
    y = (r + 1e-4 * torch.randn(64, 500, dtype=torch.float64)).float()
    sized = _Sized(r.numel())
    with sized:
        found = metrics.output_error("logits", y, r)
    assert sized.made.count("sub") == 1, sized.made
    assert len(sized.made) <= 14, sized.made
    d = y.double() - r
    assert found.normwise == float(torch.linalg.vector_norm(d)) / float(torch.linalg.vector_norm(r))
    assert found.normwise == metrics.normwise(y, r)
    assert found.max_abs == float(d.abs().max())
    assert found.bias == float(d.mean()) / float(r.abs().mean())
    assert sum(found.histogram) == r.numel() and found.top1 == 1.0
    assert 1e-5 < found.normwise < 1e-3


def test_a_large_output_is_compared_in_chunks_with_no_buffer_its_size_and_the_numbers_of_one_pass():
    # logits of tens of millions of numbers made about fifteen float64 buffers their size (GBs for a language
    # model's vocabulary); 3 chunks of rows here, each widened as it is read
    torch.manual_seed(0)
    rows, width = 3 * metrics.CHUNK // 2000 + 7, 2000
    r = torch.randn(rows, width, dtype=torch.float64)
    r[5, :] = 0.0  # elements below the relative floor
    y = (r + 1e-4 * torch.randn(rows, width, dtype=torch.float64)).float()
    y[-1, 3] = y[-1, 3] + 1.0  # the largest error, in the last chunk
    sized = _Sized(r.numel())
    with sized:
        found = metrics.output_error("logits", y, r)
    assert sized.made == []
    # the same metrics, each one reduction over the whole output
    d = y.double() - r
    a, ref_abs = d.abs(), r.abs()
    big = ref_abs >= metrics.REL_FLOOR * ref_abs.max()
    rel = a[big] / ref_abs[big]
    assert found.max_abs == float(a.max()) and found.max_rel == float(rel.max())
    assert found.mean_rel == pytest.approx(float(rel.mean()), rel=1e-12)
    assert found.normwise == pytest.approx(float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(r)),
                                           rel=1e-12)
    assert found.bias == pytest.approx(float(d.mean() / ref_abs.mean()), rel=1e-9)
    cosine = torch.nn.functional.cosine_similarity(y.double(), r, dim=-1, eps=1e-300)
    assert found.cosine == float(cosine.min())
    assert found.top1 == float((y.argmax(-1) == r.argmax(-1)).double().mean()) < 1.0
    rms = float(torch.linalg.vector_norm(r)) / r.numel() ** 0.5
    decade = (a / rms).clamp_min(1e-300).log10().floor().clamp(-10, 1).add(10).long().flatten()
    assert found.histogram == tuple(int(c) for c in torch.bincount(decade, minlength=12))


def test_a_nan_in_one_chunk_of_an_output_is_the_largest_error_of_the_whole():
    r = torch.ones(3 * metrics.CHUNK // 1000, 1000, dtype=torch.float64)
    y = r.clone()
    y[1, 0] = math.nan  # the first chunk: later chunks' maxima must not hide it
    found = metrics.output_error("out", y, r)
    assert math.isnan(found.max_abs) and math.isnan(found.max_rel) and math.isnan(found.normwise)
    assert found.histogram[-1] == 1 and sum(found.histogram) == r.numel()


def test_layer_reruns_pass_no_op_through_the_float64_run(monkeypatch):
    passed, rerunning = [], []
    original, reruns = reference._Ops.__torch_dispatch__, layers.Recorder._reruns

    def counting(self, func, types, args=(), kwargs=None):
        if rerunning:
            passed.append(func)
        return original(self, func, types, args, kwargs)

    def flagged(self, *args, **kwargs):
        rerunning.append(True)
        try:
            return reruns(self, *args, **kwargs)
        finally:
            rerunning.pop()

    monkeypatch.setattr(reference._Ops, "__torch_dispatch__", counting)
    monkeypatch.setattr(layers.Recorder, "_reruns", flagged)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32), name="mlp"), introduced="all",
                           levels=("highest", "high"))
    assert passed == []
    introduced = {layer.name: layer.introduced for layer in report.level("high").layers}
    assert set(introduced) == {"0", "2"} and all(0 < v < 1e-2 for v in introduced.values())


def test_the_kept_ops_are_swept_only_when_a_result_has_gone(monkeypatch):
    from tf32lab.measure import scales

    asked = []
    alive = scales._Entry.alive
    monkeypatch.setattr(scales._Entry, "alive", lambda entry: asked.append(1) or alive(entry))
    x = torch.randn(8, dtype=torch.float64)
    held = []
    with scales.Formed() as formed:
        for _ in range(200):  # every result held: nothing to sweep, whatever the number of ops
            held.append(x * 2.0)
    assert asked == []
    assert len(formed.kept) == scales.KEPT
    with scales.Formed() as formed:
        kept = x * 3.0
        for _ in range(40):
            _ = x + 1.0  # results dropped at once: swept, and what the run still holds stays kept
        last = x - 1.0
    assert asked
    assert formed.kept[-1].results[0]() is last
    assert any(e.results[0]() is kept for e in formed.kept)
    assert all(e.alive() for e in formed.kept)


def test_counting_looks_an_op_up_once_and_counts_as_before(monkeypatch):
    from tf32lab.know import optable
    from tf32lab.speed import counting

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 16)
    with counting.Counting(model) as first, torch.inference_mode():
        model(x)
    looked = []
    family = optable.family
    monkeypatch.setattr(optable, "family", lambda name: looked.append(name) or family(name))
    with counting.Counting(model) as again, torch.inference_mode():
        for _ in range(10):
            model(x)
    assert looked == []  # each overload's name, family and kind known from the first run
    assert again.ops[:len(first.ops)] == first.ops
    assert [(c.op, c.layer, c.flops, c.bytes, c.gemms, c.kind) for c in first.ops] == [
        ("aten::linear", "0", 2 * 5 * 16 * 16, (5 * 16 + 16 * 16 + 16 + 5 * 16) * 4.0, ((1, 1, 5, 16, 16),),
         "gemm"),
        ("aten::gelu", "1", 0.0, 2 * 5 * 16 * 4.0, (), "elementwise"),
        ("aten::linear", "2", 2 * 5 * 16 * 4, (5 * 16 + 4 * 16 + 4 + 5 * 4) * 4.0, ((1, 1, 5, 4, 16),), "gemm")]


def test_the_float64_run_reads_an_op_once_and_the_scale_recorder_rides_in_its_mode(monkeypatch):
    """A decoder runs hundreds of small ops per forward, each through every mode of the reference run: the
    recorder's family lookup, the run's data-mover and write tests are made once per op overload (or call), and the
    scale recorder is told by the run's own mode, not through a second one; the scales found are the same."""
    from tf32lab.know import optable
    from tf32lab.measure import scales

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    asked = {"family": 0, "moves": 0, "written": 0, "mode": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            asked[name] += 1
            return fn(*args, **kwargs)
        return call

    recorder = layers.Recorder(model, ["highest"], tf32lab.targets.get("a100"))
    formed = scales.Formed(lambda: not (recorder.rerunning or recorder.mode.paused), recorder.mode)
    x = torch.randn(5, 16)
    with torch.no_grad(), recorder, formed:
        model(x)  # every op and call seen once
        monkeypatch.setattr(optable, "family", counted("family", optable.family))
        monkeypatch.setattr(reference, "moves_data", counted("moves", reference.moves_data))
        monkeypatch.setattr(reference, "_written", counted("written", reference._written))
        monkeypatch.setattr(scales._Mode, "__torch_dispatch__", counted("mode", scales._Mode.__torch_dispatch__))
        for _ in range(5):
            out = model(x)
    assert asked == {"family": 0, "moves": 0, "written": 0, "mode": 0}
    assert out.dtype == torch.float64 and recorder.family_ops == 12  # two linears a forward, told as before
    found = formed.scales(out)
    assert list(found) == ["output"] and found["output"].op == "aten::addmm"
    first, last = model[0], model[2]
    with torch.no_grad():
        hidden = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), first.weight.double(),
                                                                     first.bias.double()))
        magnitudes = torch.nn.functional.linear(hidden.abs(), last.weight.double().abs(), last.bias.double().abs())
    assert abs(found["output"].norm - float(torch.linalg.vector_norm(magnitudes))) < 1e-9 * found["output"].norm


def test_an_op_the_emulator_does_not_compute_costs_no_lookup(monkeypatch):
    from tf32lab.emulation import emulator

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 16)
    with tf32lab.emulate("a100"), tf32lab.precision("high"), torch.no_grad():
        expected = model(x)
        looked = []
        treatment = emulator.treatment
        monkeypatch.setattr(emulator, "treatment", lambda func: looked.append(func) or treatment(func))
        again = [model(x) for _ in range(5)]
    assert looked == []  # each op's treatment known from the first forward
    assert all(torch.equal(y, expected) for y in again)


class _Recurrent(torch.nn.Module):
    """An LSTM's output through a ReLU (a trailing op: its scale is the output's magnitudes), a GRU's states."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 8, 2, bidirectional=True, batch_first=True)
        self.gru = torch.nn.GRU(16, 5)

    def forward(self, x):
        out, (_, c) = self.lstm(x)
        states, last = self.gru(out.transpose(0, 1))
        return {"relu": torch.relu(out), "c": c, "states": states, "last": last}


def test_an_rnns_steps_are_not_told_to_the_scale_recorder_and_its_results_scales_are_their_own(monkeypatch):
    """A float64 RNN runs its steps without the run's op-level mode; the scale recorder was still told of every
    step (an LSTM of 160 steps: thousands of Python calls, more than its float64 forward cost). Each result of an
    RNN is a stack or cat of its steps' states, so its magnitudes are its own values': told once per result, each
    result's scale is what the step-by-step telling found, where the steps of a later RNN had not pushed it out
    of the kept ops (here they had: the LSTM's results got no scale)."""
    from tf32lab.measure import scales

    model = _Recurrent()
    x = torch.randn(3, 40, 6)
    kept = []
    monkeypatch.setattr(scales.Formed, "keep", lambda self, entry, keep=scales.Formed.keep: (
        kept.append(entry.func), keep(self, entry))[1])
    recorder = layers.Recorder(model, ["highest"], tf32lab.targets.get("a100"))
    formed = scales.Formed(lambda: not (recorder.rerunning or recorder.mode.paused), recorder.mode)
    with torch.no_grad(), recorder, formed:
        out = model(x)
    assert len(kept) < 20, f"{len(kept)} ops kept for two RNNs"
    found = formed.scales(out)
    with torch.no_grad():
        own = {name: float(torch.linalg.vector_norm(value.abs().double())) for name, value in out.items()}
        lstm_out = model.lstm.double()(x.double())[0]
    own["relu"] = float(torch.linalg.vector_norm(lstm_out.abs()))  # the ReLU trails the LSTM's output
    assert set(found) == set(own)
    for name, scale in found.items():
        assert abs(scale.norm - own[name]) <= 1e-12 * own[name], name


def test_the_float64_reference_runs_an_lstm_and_a_gru_by_whole_sequence_loops():
    """ATen's float64 LSTM has no oneDNN kernel and dispatches a dozen ops a step (5x a float32 forward of an
    LSTM encoder); the reference runs LSTMs and GRUs by the emulator's whole-sequence loops with nothing rounded,
    and PyTorch's own kernel where those do not cover the call (a projection, a packed sequence). The results are
    float64's to its last bits' order."""
    torch.manual_seed(0)
    model = _Recurrent()
    projected = torch.nn.LSTM(6, 8, proj_size=3, batch_first=True)
    x = torch.randn(3, 40, 6)
    recorder = layers.Recorder(model, ["highest"], tf32lab.targets.get("a100"))
    with torch.no_grad(), torch.profiler.profile() as profile, recorder:
        out = model(x)
        fallback = projected(x)[0]
    ran = {event.name for event in profile.events()}
    assert "aten::gru" not in ran and ran & {"aten::lstm"} == {"aten::lstm"}  # the projected one's only
    assert sum(event.name == "aten::lstm" for event in profile.events()) == 1
    with torch.no_grad():
        expected = _Recurrent.forward(model.double(), x.double())
        expected_projected = projected.double()(x.double())[0]
    for name, value in out.items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, expected[name], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fallback, expected_projected, rtol=1e-12, atol=1e-14)
