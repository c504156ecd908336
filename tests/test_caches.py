"""The emulator's caches never serve stale values, and check() leaves no rounded weights behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cli_runner
import tf32lab
from emulation_reference import randn
from tf32lab.control.scope import current_emulation
from tf32lab.emulation import emulator
from tf32lab.numbers import formats


def tf32_linear(x, layer):
    return formats.round_tf32(x) @ formats.round_tf32(layer.weight.detach()).T + layer.bias.detach()


def test_a_weight_written_through_data_inside_emulate():
    lin = torch.nn.Linear(64, 32)
    x = randn(8, 64, seed=1)
    expected = tf32_linear(x, lin)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        first = lin(x)
        lin.weight.data.mul_(0)  # .data has its own version counter: the parameter's does not move
        second = lin(x)
    assert torch.allclose(first, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(second, lin.bias.detach().expand(8, 32))


def test_a_weight_written_through_data_between_emulate_blocks():
    lin = torch.nn.Linear(64, 32)
    x = randn(8, 64, seed=2)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        lin(x)
    lin.weight.data.copy_(randn(32, 64, seed=3))
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        out = lin(x)
    assert torch.allclose(out, tf32_linear(x, lin), rtol=1e-5, atol=1e-5)


def test_an_activation_written_through_a_numpy_view_between_two_projections():
    q, k = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    hidden = randn(8, 64, seed=4)
    view = hidden.numpy()  # numpy writes bump no version counter
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        q(hidden)
        view[:] = 0.0
        keys = k(hidden)
    assert torch.equal(keys, k.bias.detach().expand(8, 32))


def test_two_checks_with_a_data_write_between_them_agree_with_a_fresh_one():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    workload = tf32lab.Workload(model, randn(16, 64, seed=6))
    tf32lab.check(workload, levels=("high",))
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p))
    second = tf32lab.check(workload, levels=("high",))
    emulator.release_buffers()
    fresh = tf32lab.check(workload, levels=("high",))
    pick = [(o.name, o.normwise) for o in second.level("high").outputs]
    assert pick == [(o.name, o.normwise) for o in fresh.level("high").outputs]
    assert [(e.name, e.introduced) for e in second.level("high").layers] == \
        [(e.name, e.introduced) for e in fresh.level("high").layers]
    assert second.level("high").passed


def test_no_rounded_copy_outlives_its_emulate_block():
    lin = torch.nn.Linear(64, 32)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        lin(randn(4, 64, seed=7))
        block = current_emulation()
        assert len(block.cache) == 1
    assert len(block.cache) == 0 and current_emulation() is None


def test_checks_rows_and_reruns_hold_no_rounded_copy_of_a_model_that_reads_each_weight_once(monkeypatch):
    kept = []  # at each emulate block's end: the rounded parameter copies it held
    clear = emulator._WeightCache.clear

    def counting(cache):
        kept.append(len(cache.entries))
        clear(cache)

    monkeypatch.setattr(emulator._WeightCache, "clear", counting)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    report = tf32lab.check(tf32lab.Workload(model, randn(16, 64, seed=9)), introduced="all", levels=("high",))
    assert report.level("high").layers and len(kept) >= 3  # the row at high, the floor and the layers' reruns
    assert kept == [0] * len(kept)


@pytest.mark.slow
def test_check_of_a_100m_parameter_mlp_retains_no_rounded_weights():
    # RSS in a fresh process: before building the model, after building it, peak, and after check().
    code = """
        import json, resource, torch, tf32lab

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**30

        torch.manual_seed(0)
        # 6 x 4096 x 4096 = 101M parameters: each weight 64 MiB, above glibc's largest mmap threshold (32 MiB), so
        # that a freed copy leaves the RSS at once; the check of 12 such layers cost twice the CPU (8.5 s) for the
        # same finding (its own growth is ~28 MiB at 6 layers as at 12, and kept copies would add 384 MiB)
        width, depth = 4096, 6
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
        built = rss()
        report = tf32lab.check(tf32lab.Workload(model, torch.randn(4, width)), levels=("high",))
        after = rss()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "built": built,
                          "after": after, "peak": peak, "passed": bool(report)}))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout)
    model_gib = rss["params"] * 4 / 2**30
    assert rss["params"] > 100e6
    # The model is ~0.375 GiB; rounded copies of every weight would add as much again.
    assert rss["after"] - rss["built"] < 0.25 * model_gib, rss


def test_the_float64_reference_convolves_in_slices_of_the_batch(tmp_path):
    """PyTorch's float64 CPU convolution unfolds the whole batch (here 520 MB of im2col); the reference's slices
    keep it under 64 MiB, measured as the growth of a process's peak RSS (one forked from the suite's CLI server,
    torch imported: the kernel resets a child's peak to its size at the fork)."""
    code = textwrap.dedent("""
        import torch
        from tf32lab.measure.reference import Float64Run

        def peak():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024

        conv = torch.nn.Conv1d(32, 32, 32)
        x = torch.randn(64, 32, 1024)
        before = peak()
        with torch.no_grad(), Float64Run():
            y = conv(x)
        assert y.dtype == torch.float64 and y.shape == (64, 32, 993)
        print(peak() - before)
    """)
    (tmp_path / "convolves_in_slices.py").write_text(code)
    done = cli_runner.run(module="convolves_in_slices", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 200, f"peak grew by {float(done.stdout):.0f} MiB"


def test_a_data_swap_inside_one_block_is_not_served_stale():
    """``p.data = other`` keeps the parameter's identity and version counter; its storage is what changes."""
    layer = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad(), tf32lab.precision("high"), tf32lab.emulate("a100"):
        layer(x)
        layer.weight.data = torch.randn(16, 16)
        after = layer(x)
    with torch.no_grad(), tf32lab.precision("high"), tf32lab.emulate("a100"):
        fresh = layer(x)
    assert torch.equal(after, fresh)


def test_the_scratch_pool_serves_a_growing_sequence_from_the_same_buffers():
    # a decoder's step reads a sequence one token longer than the last: pooled by exact size, every length left
    # buffers no later step took, 64 steps piling up hundreds of times the longest step's own scratch
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    tokens = randn(2, 64, 32, seed=2)

    def held(lengths) -> int:
        emulator.release_buffers()
        most = 0
        with torch.no_grad(), tf32lab.precision("high"), tf32lab.emulate("a100"):
            for length in lengths:
                x = tokens[:, :length]
                attention(x, x, x, need_weights=False)
                most = max(most, emulator._SCRATCH.bytes)
        return most

    try:
        longest = held([64])  # what the longest step needs
        assert 0 < held(range(1, 65)) <= 2 * longest
    finally:
        emulator.release_buffers()


def test_pooled_scratch_gives_the_same_bits_as_fresh_buffers():
    lin = torch.nn.Linear(48, 24)
    x = randn(5, 48, seed=3)
    emulator.release_buffers()
    with torch.no_grad(), tf32lab.precision("high"), tf32lab.emulate("a100"):
        fresh = lin(x)
        for length in (7, 9, 6, 5):  # buffers of other sizes in the pool: a view of a bigger one serves 5 rows
            lin(randn(length, 48, seed=length))
        pooled = lin(x)
    emulator.release_buffers()
    assert torch.equal(fresh, tf32_linear(x, lin)) and torch.equal(pooled, fresh)


def test_a_pooled_buffer_made_under_inference_mode_takes_writes_outside_it():
    # a scratch buffer first made under inference mode was an inference tensor: an emulated op outside inference
    # mode that took it from the pool and rounded into it raised "Inplace update to inference tensor outside
    # InferenceMode" (an LSTM run under inference_mode, then with gradients, in one process)
    emulator.release_buffers()
    pool = emulator._SCRATCH
    with torch.inference_mode():
        made = pool.take(1 << 14, torch.float32, torch.device("cpu"))
        pool.give([made])
    taken = pool.take(1 << 14, torch.float32, torch.device("cpu"))
    assert taken is made and not taken.is_inference()
    taken.add_(1.0)
    pool.give([taken])
    emulator.release_buffers()
