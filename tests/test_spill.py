"""Large kept reference outputs written out (tf32lab.measure.spill): read back exactly, and check's report unchanged."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import Tf32LabError
from tf32lab.measure.spill import Spilled, SpillFile, min_bytes_from_env


def test_a_spilled_tensor_reads_back_bit_for_bit_in_chunks_and_whole():
    t = torch.randn(3, 1000, dtype=torch.float64)
    with SpillFile(min_bytes=1) as spill:
        small = spill.put(torch.randn(2, dtype=torch.float32))  # not float64: kept as it is
        kept = spill.put(t)
        assert isinstance(kept, Spilled) and not isinstance(small, Spilled) and kept.shape == t.shape
        buffer = torch.empty(777, dtype=torch.float64)
        parts = [part.clone() for part in kept.chunks(buffer)]
        assert [p.numel() for p in parts] == [777, 777, 777, 669]
        assert torch.equal(torch.cat(parts), t.reshape(-1))
        assert torch.equal(kept.load(), t) and torch.equal(kept.load(torch.float32), t.float())
        assert spill.written == t.numel() * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64])
def test_a_held_tensor_of_any_dtype_comes_back_bit_for_bit(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    with SpillFile(min_bytes=1) as spill:
        held = spill.hold(t)
        assert isinstance(held, Spilled) and held.dtype == dtype
        back = held.load()
        assert back.dtype == dtype and back.shape == t.shape and back.is_contiguous()
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # the bits, NaN payloads included
        assert spill.written == t.numel() * t.element_size()
        with pytest.raises(Tf32LabError, match="reads back into a"):
            next(held.chunks(torch.empty(4, dtype=torch.float64 if dtype != torch.float64 else torch.float32)))


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),  # a channels-last conv's output
    lambda: torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
    lambda: torch.randn(6, 7).t(),
    lambda: torch.randn(3, 1, 4, 5).permute(0, 2, 1, 3),
])
def test_a_tensor_that_fills_its_memory_comes_back_laid_out_as_it_was(make):
    t = make()
    with SpillFile(min_bytes=1) as spill:
        held = spill.hold(t)
        assert isinstance(held, Spilled) and spill.written == t.numel() * 4
        back = held.load()
        assert back.stride() == t.stride() and torch.equal(back, t)


def test_a_view_with_gaps_or_a_subclass_is_not_held():
    with SpillFile(min_bytes=1) as spill:
        sliced = torch.randn(4, 6)[:, ::2]
        overlapping = torch.randn(3).expand(4, 3)
        parameter = torch.nn.Parameter(torch.randn(10))
        assert spill.hold(sliced) is sliced and spill.hold(overlapping) is overlapping
        assert spill.hold(parameter) is parameter and spill.written == 0
        small = torch.randn(10)
        assert SpillFile(min_bytes=41).hold(small) is small  # under the size: as it is


def test_a_lazily_conjugated_or_negated_tensor_is_not_held_and_a_strided_one_comes_back_so():
    # a conjugate or negative view has no plain bits to write (viewing it as bytes raises): its caller copies it
    with SpillFile(min_bytes=1) as spill:
        conjugated = torch.randn(6, dtype=torch.complex64).conj()
        negated = torch._neg_view(torch.randn(6))
        assert spill.hold(conjugated) is conjugated and spill.hold(negated) is negated and spill.written == 0
        odd = torch.randn(5, 1, 7).transpose(0, 1)  # contiguous, its size-1 dimension's stride 7, not 35
        back = spill.hold(odd).load()
        assert back.stride() == odd.stride() == (7, 7, 1) and torch.equal(back, odd)


def test_below_the_size_or_with_no_size_a_tensor_stays_in_memory():
    t = torch.randn(100, dtype=torch.float64)
    assert SpillFile(min_bytes=801).put(t) is t
    assert SpillFile(min_bytes=None).put(t) is t


def test_a_folder_that_cannot_be_written_keeps_everything_in_memory(tmp_path):
    t = torch.randn(100, dtype=torch.float64)
    spill = SpillFile(min_bytes=1, directory=tmp_path / "missing")
    assert spill.put(t) is t and spill.put(t) is t and spill.written == 0


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="a file size limit is POSIX's")
def test_a_file_that_fills_up_keeps_the_rest_in_memory_and_closes_quietly():
    # a write that the disk refused stayed in the file object's buffer, and close() tried it again: every check
    # whose spill file filled up (a small TF32LAB_SPILL_MIB) ended in "OSError: [Errno 27] File too large"
    resource = pytest.importorskip("resource")
    tensors = [torch.randn(256) for _ in range(4)]  # 1 KiB each: the third does not fit in 2500 bytes
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit's signal would end the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2500, hard))
        spill = SpillFile(min_bytes=1)
        held = [spill.hold(t) for t in tensors]
        spill.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert [isinstance(h, Spilled) for h in held] == [True, True, False, False] and spill.written == 2048
    assert held[2] is tensors[2] and held[3] is tensors[3]


@pytest.mark.parametrize("raw, expected", [("", 32 << 20), ("0", None), ("0.5", 1 << 19), ("64", 64 << 20)])
def test_the_size_comes_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv("TF32LAB_SPILL_MIB", raw)
    assert min_bytes_from_env() == expected


@pytest.mark.parametrize("raw", ["lots", "-1", "nan", "inf", "1e400"])
def test_a_bad_size_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("TF32LAB_SPILL_MIB", raw)
    with pytest.raises(Tf32LabError, match=rf"TF32LAB_SPILL_MIB='{raw}' is not understood; accepted: a finite "
                                           rf"number of MiB >= 0"):
        min_bytes_from_env()


class _Front(torch.nn.Module):
    """A convolutional front end whose first activation outweighs the rest; the model's own product makes it a
    layer with layers inside, which answer its rerun with their (written out) reference outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 32, 64, stride=2)
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.mix = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x[:, None, :]))
        return self.head(h.mean(dim=2)) @ self.mix


def _check(monkeypatch, mib: str) -> dict:
    monkeypatch.setenv("TF32LAB_SPILL_MIB", mib)
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Front(), torch.randn(16, 2048) * 10 + 3, name="front")
    report = tf32lab.check(workload, introduced="all", levels=("highest", "high"), speed=False).to_dict()
    return {"levels": report["levels"], "notes": report["notes"]}


def _without_times(value):
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def test_check_gives_the_same_report_with_every_layer_written_out(monkeypatch):
    # 0.001 MiB: every layer's float64 output goes to the file; the errors are the same to the last bit
    spilled, kept = _check(monkeypatch, "0.001"), _check(monkeypatch, "0")
    assert _without_times(spilled) == _without_times(kept)
    layers = {layer["name"] for level in kept["levels"] for layer in level["layers"]}
    assert {"(model)", "conv", "head.0", "head.2"} <= layers
    assert any(layer["introduced"] > 0 for level in kept["levels"] for layer in level["layers"])


@pytest.mark.parametrize("raw", ["lots", "inf"])
def test_a_bad_spill_size_through_the_cli_is_one_line_and_exit_2(raw):
    done = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", module="tf32lab.cli", timeout=300,
                          env={**os.environ, "TF32LAB_SPILL_MIB": raw})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"TF32LAB_SPILL_MIB='{raw}' is not understood; accepted: a finite number" in lines[0], \
        done.stderr
    assert "OverflowError" not in done.stderr


def test_check_writes_out_what_is_over_the_size_and_the_file_is_gone_after(monkeypatch):
    from tf32lab import targets
    from tf32lab.measure.check import Session
    from tf32lab.numbers.metrics import tolerances_of

    monkeypatch.setenv("TF32LAB_SPILL_MIB", "1")
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Front(), torch.randn(16, 2048), name="front")
    with Session(workload, ["high"], targets.get("a100"), tolerances_of(None), speed=False) as session:
        kept = {name: isinstance(ref, Spilled) for (name, _), (ref, _) in session.recorder.outputs.items()}
        assert kept == {"conv": True, "head.0": False, "head.2": False, "(model)": False}  # conv: 3.9 MiB
        assert session.spill.written == 16 * 32 * 993 * 8
        assert session.level("high").error is None
    assert session.spill._file is None


def test_the_second_float64_pass_writes_its_outputs_over_the_first_ones_not_after_them(monkeypatch):
    # where a level fails, the reference runs again: the first pass's written-out outputs, which nothing reads
    # any more, took as much disk again (and a disk that filled up kept the second pass's in memory)
    from tf32lab import targets
    from tf32lab.measure.check import Session
    from tf32lab.numbers.metrics import tolerances_of

    monkeypatch.setenv("TF32LAB_SPILL_MIB", "1")
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Front(), torch.randn(16, 2048), name="front")
    one_pass = 16 * 32 * 993 * 8  # conv's output, the one over 1 MiB
    with Session(workload, ["high"], targets.get("a100"), tolerances_of(None), speed=False, rerun=[]) as session:
        assert os.fstat(session.spill._file.fileno()).st_size == one_pass
        row = session.level("high")
        session.introduce(["high"])
        assert os.fstat(session.spill._file.fileno()).st_size == one_pass and session.spill.written == one_pass
        assert isinstance(session.recorder.outputs[("conv", 0)][0], Spilled)
        assert session.introduced_at(row).layers[0].introduced > 0


class _DrawingFront(_Front):
    """``_Front`` fed noise drawn at a dtype read off a tensor made in the forward (float64 in the reference, float32
    in the rows): the first row teaches the reference its draws, and the reference runs again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = (x * 2).dtype  # read off a widened tensor in the reference, and kept
        made = x * 2
        noise = made * 0 + torch.randn(x.shape, dtype=kind, generator=torch.Generator().manual_seed(1))
        return super().forward(x + 1e-3 * noise.float())


def test_a_reference_run_again_for_its_draws_writes_over_the_first_one_not_after_it(monkeypatch):
    # the first pass's written-out outputs and the first row's hand-off to the next (both run again) took as much
    # disk again, and a disk that filled up kept the second pass's outputs in memory
    from tf32lab import targets
    from tf32lab.measure.check import Session
    from tf32lab.numbers.metrics import tolerances_of

    monkeypatch.setenv("TF32LAB_SPILL_MIB", "1")
    torch.manual_seed(0)
    workload = tf32lab.Workload(_DrawingFront(), torch.randn(16, 2048), name="front")
    one_pass = 16 * 32 * 993 * 8  # conv's float64 output, the one over 1 MiB
    handed = one_pass // 2  # the conv's float32 output, which `high` takes from the `highest` row (cuDNN's alike)
    with Session(workload, ["highest", "high"], targets.get("a100"), tolerances_of(None), speed=False,
                 rerun=[]) as session:
        assert os.fstat(session.spill._file.fileno()).st_size == one_pass
        first = session.level("highest")
        assert any("run again drawing each as the rows do" in note for note in session.notes()), session.notes()
        assert os.fstat(session.spill._file.fileno()).st_size == one_pass + handed
        assert isinstance(session.recorder.outputs[("conv", 0)][0], Spilled)
        second = session.level("high")
    assert first.error is None and second.error is None and first.outputs[0].passed and second.outputs[0].passed
