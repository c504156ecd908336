"""tf32lab.numbers.formats against the plain-Python-integer reference (tests/reference.py), and its contract."""

from __future__ import annotations

import os
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cli_runner
import reference as R
from tf32lab.numbers import compiled, formats

ROOT = Path(__file__).resolve().parent.parent


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def tensor_of(patterns: list[int]) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def patterns_of(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.contiguous().view(torch.int32).tolist()]


def is_nan(bits: int) -> bool:
    return (bits & 0x7FFFFFFF) > 0x7F800000


def assert_same(got: torch.Tensor, want: list[int], inputs: list[int]) -> None:
    for x, g, w in zip(inputs, patterns_of(got), want):
        assert g == w or (is_nan(g) and is_nan(w)), f"input {x:#010x}: got {g:#010x}, reference {w:#010x}"


# Bit patterns that matter: anything, plus ties and near-ties at every dropped width, subnormals, the edges of
# the range, NaN payloads hidden in low bits.
low_bits = st.sampled_from([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF,
                            0x17FFF, 0x18000])
structured = st.builds(
    lambda sign, exp, high, low: (sign << 31) | (exp << 23) | ((high << 16 | low) & 0x7FFFFF),
    st.integers(0, 1),
    st.one_of(st.integers(0, 255), st.sampled_from([0, 1, 102, 103, 112, 113, 142, 143, 253, 254, 255])),
    st.integers(0, 127),
    low_bits,
)
patterns = st.lists(st.one_of(st.integers(0, 2**32 - 1), structured), min_size=1, max_size=64)


@given(patterns, st.sampled_from(formats.ROUNDINGS))
def test_round_tf32_matches_reference(bits, rounding):
    assert_same(formats.round_tf32(tensor_of(bits), rounding), [R.ref_round_tf32(b, rounding) for b in bits], bits)


@given(patterns, st.sampled_from(formats.ROUNDINGS))
def test_round_bf16_matches_reference(bits, rounding):
    assert_same(formats.round_bf16(tensor_of(bits), rounding), [R.ref_round_bf16(b, rounding) for b in bits], bits)


@given(patterns)
def test_round_fp16_matches_reference(bits):
    assert_same(formats.round_fp16(tensor_of(bits)), [R.ref_round_fp16(b) for b in bits], bits)


@pytest.mark.parametrize("split, ref", [(formats.split_bf16x3, R.ref_split_bf16x3),
                                        (formats.split_tf32x3, R.ref_split_tf32x3),
                                        (formats.split_bf16x9, R.ref_split_bf16x9)])
@given(bits=patterns)
def test_splits_match_reference(split, ref, bits):
    parts = split(tensor_of(bits))
    want = [ref(b) for b in bits]
    for i, part in enumerate(parts):
        assert_same(part, [w[i] for w in want], bits)


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**100), max_value=2.0**100),
                min_size=1, max_size=32))
def test_splits_keep_more_bits_than_one_part(values):
    x = torch.tensor(values, dtype=torch.float32)
    hi, lo = formats.split_bf16x3(x)
    big, small = formats.split_tf32x3(x)
    xd = x.double()
    # hi + lo holds 16 significant bits, big + small 21 or more: relative error bounds 2**-16 and 2**-21.
    assert torch.all((hi.double() + lo.double() - xd).abs() <= xd.abs() * 2**-16 + 2**-133)
    assert torch.all((big.double() + small.double() - xd).abs() <= xd.abs() * 2**-21 + 2**-133)
    # three bf16 parts hold all 24 bits of a float32 (bfx9), unless the last part falls below bf16's subnormals
    hi, mid, lo = formats.split_bf16x9(x)
    parts = hi.double() + mid.double() + lo.double()
    assert torch.all((parts == xd) | (xd.abs() < 2.0**-100))
    assert all(torch.equal(formats.round_bf16(p), p) for p in (hi, mid, lo))


def test_the_rna_pin_from_pytorch_53635():
    # [1024.5] @ [[1.0]] gave 1025 on an RTX 3090: operands rounded ties-away. (cuBLAS on an H100 rounds ties to
    # even instead: the h100 target asks for "rne", tests/test_emulate.py.)
    x = torch.tensor([1024.5])
    assert formats.round_tf32(x).item() == 1025.0
    assert formats.round_tf32(x, "rne").item() == 1024.0
    assert formats.round_tf32(x, "rz").item() == 1024.0


@pytest.mark.parametrize("fn", [
    lambda x: formats.round_tf32(x, "rna"), lambda x: formats.round_tf32(x, "rne"),
    lambda x: formats.round_tf32(x, "rz"), lambda x: formats.round_bf16(x, "rna"),
    lambda x: formats.round_bf16(x, "rne"), lambda x: formats.round_bf16(x, "rz"), formats.round_fp16,
])
def test_ieee_special_values(fn):
    nan_low_payload = [0x7F800001, 0xFF800001, 0x7F801000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000]
    out = fn(tensor_of(nan_low_payload))
    assert torch.isnan(out).all(), "a NaN must stay NaN whatever its payload"
    inf = fn(torch.tensor([float("inf"), float("-inf")]))
    assert inf.tolist() == [float("inf"), float("-inf")]
    zeros = fn(torch.tensor([0.0, -0.0]))
    assert patterns_of(zeros) == [0, 0x80000000], "zeros keep their sign"


def test_overflow_follows_the_rounding_mode():
    fmax = torch.tensor([f32(0x7F7FFFFF), -f32(0x7F7FFFFF)])
    assert formats.round_tf32(fmax, "rna").tolist() == [float("inf"), float("-inf")]
    assert formats.round_tf32(fmax, "rne").tolist() == [float("inf"), float("-inf")]
    assert patterns_of(formats.round_tf32(fmax, "rz")) == [0x7F7FE000, 0xFF7FE000]  # truncation stays finite
    assert formats.round_fp16(torch.tensor([65504.0, 65519.99, 65520.0, -65520.0])).tolist() == [
        65504.0, 65504.0, float("inf"), float("-inf")]


def test_subnormals_round_on_their_own_grid():
    tiny = tensor_of([0x00001000, 0x00001001, 0x00003000, 0x80001000])  # ties and a near-tie below 2**-126
    assert patterns_of(formats.round_tf32(tiny, "rna")) == [0x2000, 0x2000, 0x4000, 0x80002000]
    assert patterns_of(formats.round_tf32(tiny, "rne")) == [0x0000, 0x2000, 0x4000, 0x80000000]
    assert formats.round_fp16(torch.tensor([2.0**-24, 2.0**-25, 3 * 2.0**-26])).tolist() == [2.0**-24, 0.0, 2.0**-24]


def test_input_untouched_and_result_new():
    x = torch.randn(1000)
    before = x.clone()
    for fn in (formats.round_tf32, formats.round_bf16, formats.round_fp16):
        y = fn(x)
        assert y.data_ptr() != x.data_ptr()
    formats.split_bf16x3(x)
    formats.split_bf16x9(x)
    formats.split_tf32x3(x)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("make", [
    lambda: torch.randn(()),
    lambda: torch.randn(0, 3),
    lambda: torch.randn(7, 5, 3),
    lambda: torch.randn(64, 48).t(),
    lambda: torch.randn(40, 30)[::3, 1::2],
    lambda: torch.randn(4, 1).expand(4, 6),
    lambda: torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
])
def test_any_shape_and_stride(make):
    x = make()
    for fn in (formats.round_tf32, formats.round_bf16, formats.round_fp16,
               lambda t: formats.round_tf32(t, "rne"), lambda t: formats.round_bf16(t, "rz")):
        y = fn(x)
        assert y.shape == x.shape and y.dtype == torch.float32
        assert torch.equal(y.contiguous().view(torch.int32), fn(x.contiguous()).view(torch.int32))


def test_requires_grad_input():
    x = torch.randn(8, requires_grad=True)
    y = formats.round_tf32(x)
    assert not y.requires_grad
    assert torch.equal(y, formats.round_tf32(x.detach()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_bits_on_cuda():
    x = torch.randn(4096) * 1e3
    for fn in (formats.round_tf32, formats.round_bf16, formats.round_fp16):
        assert torch.equal(fn(x.cuda()).cpu().view(torch.int32), fn(x).view(torch.int32))


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16),
                                 torch.zeros(3, dtype=torch.int32)])
def test_non_float32_gets_a_type_error_naming_the_dtype(bad):
    for fn in (formats.round_tf32, formats.round_bf16, formats.round_fp16, formats.split_bf16x3,
               formats.split_tf32x3, formats.split_bf16x9):
        with pytest.raises(TypeError, match=str(bad.dtype)):
            fn(bad)


def test_non_tensor_gets_a_type_error():
    with pytest.raises(TypeError, match="list"):
        formats.round_tf32([1.0, 2.0])


def test_unknown_rounding_lists_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown rounding 'nearest'; accepted: 'rna', 'rne', 'rz'"):
        formats.round_tf32(torch.zeros(2), "nearest")
    with pytest.raises(ValueError, match="'rna', 'rne', 'rz'"):
        formats.round_bf16(torch.zeros(2), rounding="up")


def test_sweep_script_on_a_slice():
    # The all-patterns sweep, run for real on the slice around FLT_MAX, Inf and the NaNs: as `python -m
    # sweep_formats` in scripts/ (its folder first on the path, as running the file puts it), forked from the
    # suite's CLI server, torch imported there
    done = cli_runner.run("--start", "0x7F7F8000", "--count", "0x10000", "--workers", "1", module="sweep_formats",
                          cwd=ROOT / "scripts", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "mismatches" in ln]
    assert len(lines) == 10 and all(ln.split()[-1] == "0" for ln in lines), done.stdout


# -- the compiled kernel (numba): one pass, the same bits as the tensor code -----------------------------------------
numba_only = pytest.mark.skipif(not formats.load_compiled(), reason="numba not installed")
SPECIALS = [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FF000, 0x00000001, 0x80000001, 0x007FFFFF,
            0x00001000, 0x00001001, 0x80000000, 0x00000000, 0x3F801000, 0x3F803000, 0x3F808000, 0x3F818000,
            0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFF000, 0xFFFFFFFF, 0x7FBFFFFF]


def _many_patterns(finite: bool = False) -> torch.Tensor:
    """2^17 bit patterns: random ones, and every special case above at both ends and in the middle."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 17,), dtype=torch.int32, generator=gen)
    specials = torch.tensor(SPECIALS, dtype=torch.int64).to(torch.int32)
    for at in (0, 60000, (1 << 17) - len(SPECIALS)):
        bits[at:at + len(SPECIALS)] = specials
    x = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), x, 1.5) if finite else x


def _tensor_code(fn, *args, **kwargs):
    saved, formats.COMPILED_FROM = formats.COMPILED_FROM, 1 << 62
    try:
        return fn(*args, **kwargs)
    finally:
        formats.COMPILED_FROM = saved


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@numba_only
@pytest.mark.parametrize("fn, rounding", [(formats.round_tf32, r) for r in formats.ROUNDINGS]
                         + [(formats.round_bf16, "rna"), (formats.round_bf16, "rz")])
def test_compiled_rounding_gives_the_tensor_codes_bits(fn, rounding):
    x = _many_patterns()
    want = _tensor_code(fn, x, rounding)
    assert _same_bits(fn(x, rounding), want)  # NaN payloads and signs included
    inplace = x.clone()
    assert fn(inplace, rounding, out=inplace) is inplace and _same_bits(inplace, want)
    # the reference agrees on the special cases and a slice of the rest
    sample = SPECIALS + patterns_of(x[1000:1200])
    ref = R.ref_round_tf32 if fn is formats.round_tf32 else R.ref_round_bf16
    assert_same(fn(x, rounding)[:len(SPECIALS)], [ref(b, rounding) for b in SPECIALS], SPECIALS)
    assert_same(fn(tensor_of(sample).repeat(100), rounding)[:len(sample)], [ref(b, rounding) for b in sample], sample)


@numba_only
def test_compiled_rounding_reads_any_dense_layout():
    x = _many_patterns().view(8, 16, 32, 32)
    heads = x.transpose(1, 2)  # attention's (batch, heads, tokens, dim) view of (batch, tokens, heads, dim)
    want = _tensor_code(formats.round_tf32, heads)
    for out in (torch.empty_like(heads), torch.empty(heads.shape), torch.empty(heads.mT.shape).mT):
        got = formats.round_tf32(heads, out=out)
        assert got is out and _same_bits(got, want)
    assert _same_bits(heads, _many_patterns().view(8, 16, 32, 32).transpose(1, 2))  # the input untouched
    gaps = torch.empty(8, 32, 16, 64)[..., :32]  # an output with gaps: the tensor code writes it
    assert _same_bits(formats.round_tf32(heads, out=gaps), want)
    # inputs with gaps, read where they lie: a fused projection's slice, every other column
    q = _many_patterns()[:4 * 32 * 3 * 8 * 32].view(4, 32, 3, 8, 32)[:, :, 1].transpose(1, 2)
    strided = _many_patterns().view(256, 512)[:, 1::2]
    for t in (q, q.mT, strided):
        for rounding in formats.ROUNDINGS:
            assert _same_bits(formats.round_tf32(t, rounding), _tensor_code(formats.round_tf32, t, rounding))
    inplace = heads.clone()
    assert _same_bits(formats.round_bf16(inplace, out=inplace), _tensor_code(formats.round_bf16, heads))


@numba_only
def test_compiled_split_tf32x3_gives_the_tensor_codes_bits():
    x = _many_patterns(finite=True).view(64, 2048).T  # finite: the compiled split, on a transposed view
    want = _tensor_code(formats.split_tf32x3, x)
    got = formats.split_tf32x3(x)
    assert all(_same_bits(g, w) for g, w in zip(got, want))
    sample = SPECIALS[:16] + patterns_of(x.reshape(-1)[:200])
    finite = [b for b in sample if (b & 0x7F800000) != 0x7F800000]
    parts = formats.split_tf32x3(tensor_of(finite).repeat(200))
    assert_same(parts[0][:len(finite)], [R.ref_split_tf32x3(b)[0] for b in finite], finite)
    assert_same(parts[1][:len(finite)], [R.ref_split_tf32x3(b)[1] for b in finite], finite)
    # an Inf or a NaN anywhere: the tensor code's rules (NaN parts), nothing lost
    special = _many_patterns()
    want = _tensor_code(formats.split_tf32x3, special)
    assert all(_same_bits(g, w) for g, w in zip(formats.split_tf32x3(special), want))


@numba_only
@pytest.mark.parametrize("summed", [False, True], ids=["parts", "summed"])
def test_compiled_split_reads_strided_operands_in_place(summed):
    x = _many_patterns(finite=True)
    qkv = x[:4 * 32 * 3 * 8 * 32].view(4, 32, 3, 8, 32)  # a fused projection's (batch, tokens, q/k/v, heads, dim)
    q = qkv[:, :, 0].transpose(1, 2)  # (batch, heads, tokens, dim), gaps between its rows
    views = {"heads": q, "keys transposed": q.mT, "rows strided": x.view(256, 512)[:, ::2],
             "five dims": x.view(2, 2, 32, 32, 32).transpose(2, 3),  # two of them merged: four
             "five dims reversed": x.view(2, 2, 32, 32, 32).permute(4, 3, 2, 1, 0)}  # none merged: the tensor code
    for name, t in views.items():
        want = _tensor_code(formats.split_tf32x3, t, summed=summed)
        for out in ((torch.empty(t.shape), torch.empty(t.shape)),
                    (torch.empty(t.mT.shape).mT, torch.empty(t.mT.shape).mT)):  # dense by rows or by columns
            got = formats.split_tf32x3(t, out=out, summed=summed)
            assert all(g is o for g, o in zip(got, out)), name
            assert all(_same_bits(g, w) for g, w in zip(got, want)), name
    big, small = _tensor_code(formats.split_tf32x3, q)
    assert _same_bits(formats.split_tf32x3(q, summed=True)[1], big + small)  # the sum as float32 adds it
    special = _many_patterns().view(4, 32, 32, 32).transpose(1, 2)  # an Inf or a NaN: the tensor code's parts
    want = _tensor_code(formats.split_tf32x3, special, summed=summed)
    assert all(_same_bits(g, w) for g, w in zip(formats.split_tf32x3(special, summed=summed), want))


@numba_only
@pytest.mark.parametrize("summed", [False, True], ids=["parts", "summed"])
def test_compiled_split_writes_the_halves_of_a_concatenated_operand(summed):
    # an emulated attention's products are one GEMM over K doubled: the parts go straight into the two halves of
    # one buffer, with gaps between the rows of each; in one pass, the tensor code's bits
    x = _many_patterns(finite=True)
    heads = x[:4 * 32 * 3 * 8 * 32].view(4, 32, 3, 8, 32)[:, :, 0].transpose(1, 2)  # (4, 8, 32, 32), by rows
    keys = heads.mT  # by columns
    for name, t, halves in (("left", heads, lambda buf: (buf[..., :32], buf[..., 32:])),
                            ("right", heads, lambda buf: (buf[..., 32:, :], buf[..., :32, :])),
                            ("right by columns", keys, lambda buf: (buf.mT[..., 32:], buf.mT[..., :32]))):
        shape = (4, 8, 32, 64) if name == "left" else (4, 8, 64, 32)
        want = _tensor_code(formats.split_tf32x3, t, summed=summed)
        got = formats.split_tf32x3(t, out=halves(torch.full(shape, float("nan"))), summed=summed)
        assert formats._strided(t, *halves(torch.empty(shape))) is not None, name  # the kernel, not the tensor code
        assert all(_same_bits(g, w) for g, w in zip(got, want)), name
    special = _many_patterns().view(4, 32, 32, 32).transpose(1, 2)  # an Inf or a NaN: the tensor code's parts
    buf = torch.empty(4, 32, 32, 64)
    got = formats.split_tf32x3(special, out=(buf[..., :32], buf[..., 32:]), summed=summed)
    want = _tensor_code(formats.split_tf32x3, special, summed=summed)
    assert all(_same_bits(g, w) for g, w in zip(got, want))


@numba_only
def test_compiled_split_refuses_outputs_that_share_elements():
    x = _many_patterns(finite=True)[:32 * 32 * 64].view(32, 32, 64)[..., :32]
    buf = torch.empty(32, 32, 64)
    first = buf[..., :32]
    assert formats._strided(x, first, buf[..., 32:]) is not None  # the halves: apart
    assert formats._strided(x[1:], buf[1:, :, :32], buf[:-1, :, 32:]) is not None  # a matrix apart, and a half
    assert formats._strided(x, first, buf[..., 16:48]) is None  # rows that meet: the tensor code writes them
    assert formats._strided(x, first, buf[..., 31:63]) is None  # one element of each row in common
    assert formats._meets(32 * 64, [32, 32, 32], [32 * 64, 64, 1])  # the next matrix's first row
    assert formats._meets(31, [32, 32, 32], [32 * 64, 64, 1])
    assert not formats._meets(32, [32, 32, 32], [32 * 64, 64, 1])  # the other half of each row


@numba_only
def test_the_rounding_kernel_is_compiled_once_whatever_its_callers_pass():
    # numba compiled a kernel anew for each type of argument it met: a read-only source, numpy integers, a flag
    # given as an int, a transposed operand read in place
    from numba.core.dispatcher import Dispatcher

    from tf32lab.numbers import rounding_kernels

    x = _many_patterns().view(256, 512)
    for y in (x, x.T, x[:, ::2]):
        assert _same_bits(formats.round_tf32(y, "rne"), _tensor_code(formats.round_tf32, y, "rne"))
        got = formats.split_tf32x3(_many_patterns(finite=True).view(256, 512).T, summed=1)
        want = _tensor_code(formats.split_tf32x3, _many_patterns(finite=True).view(256, 512).T, summed=True)
        assert all(_same_bits(g, w) for g, w in zip(got, want))
    frozen = x.view(torch.int32).reshape(-1).numpy().copy()
    frozen.flags.writeable = False
    got = rounding_kernels.round_bits(frozen, (np.int64(0), 0, 0, np.int32(1)), (1, 1, 1, np.int64(frozen.size)),
                                      np.empty_like(frozen), np.int32(13), "rna")
    assert _same_bits(torch.from_numpy(got).view(torch.float32), _tensor_code(formats.round_tf32, x, "rna").reshape(-1))
    found = {name: getattr(f, "dispatcher", f) for name, f in vars(rounding_kernels).items()}
    counts = {name: len(d.signatures) for name, d in found.items() if isinstance(d, Dispatcher)}
    assert counts["_each"] == 1 and max(counts.values()) == 1, counts


@numba_only
def test_compiled_kernels_leave_empty_operands_to_the_tensor_code(monkeypatch):
    monkeypatch.setattr(formats, "COMPILED_FROM", 0)
    assert formats.round_tf32(torch.empty(5, 0).T).shape == (0, 5)
    assert [p.shape for p in formats.split_tf32x3(torch.empty(0, 3, 4).transpose(1, 2))] == [(0, 4, 3)] * 2


def test_summed_splits_hold_the_sum_of_the_parts():
    x = torch.randn(300, 7)
    for split in (formats.split_tf32x3, formats.split_bf16x3):
        big, small = split(x)
        summed = split(x, summed=True)
        assert _same_bits(summed[0], big) and _same_bits(summed[1], big + small)


@pytest.mark.parametrize("split, count", [(formats.split_tf32x3, 2), (formats.split_bf16x3, 2),
                                          (formats.split_bf16x9, 3)])
def test_split_checks_every_part_of_out(split, count):
    x = torch.randn(200, 100)
    parts = [torch.empty(200, 100) for _ in range(count)]
    parts[-1] = torch.zeros(200 * 100)[:100].view(1, 100)  # a last part of the wrong shape: refused, not overrun
    with pytest.raises(ValueError, match=r"shape \(200, 100\)"):
        split(x, out=tuple(parts))
    with pytest.raises(ValueError, match=f"{count} float32 tensors"):
        split(x, out=tuple(parts[:1]))
    with pytest.raises(ValueError, match=f"{count} float32 tensors"):
        split(x, out=(*parts[:-1], None))
    same = torch.empty(200, 100)
    with pytest.raises(ValueError, match="same memory"):
        split(x, out=(same,) * count)


@pytest.mark.parametrize("size", [64, 1 << 15])  # the tensor code, and the compiled kernel where installed
def test_a_split_into_its_own_input_splits_the_input(size):
    x = torch.full((size,), 1.0 + 2**-11 + 2**-20)
    want = formats.split_tf32x3(x)
    y = x.clone()
    got = formats.split_tf32x3(y, out=(y, torch.empty_like(y)))  # big written over x: small still from x
    assert got[0] is y and all(_same_bits(g, w) for g, w in zip(got, want)) and got[1][0].item() > 0


@pytest.mark.parametrize("size", [64, 1 << 15])
def test_an_output_overlapping_its_input_in_part_is_refused_as_torch_does(size):
    buf = torch.randn(size + 1)
    with pytest.raises(RuntimeError, match="unsupported operation"):
        formats.round_tf32(buf[:-1], out=buf[1:])


def test_the_compiled_kernels_missing_or_unusable_leave_the_tensor_code(monkeypatch):
    real_import = compiled.importlib.import_module

    def failing(name, *args):  # as numba does where it can neither write nor find a cache
        if name.endswith("rounding_kernels"):
            raise RuntimeError("cannot cache function '_round': no locator available")
        return real_import(name, *args)

    compiled.kernels.cache_clear()
    monkeypatch.setattr(compiled.importlib, "import_module", failing)
    monkeypatch.setattr(formats, "COMPILE_AFTER", 0)
    try:
        assert formats._kernels() is None and not formats.load_compiled()
        x = _many_patterns()
        assert _same_bits(formats.round_tf32(x), _tensor_code(formats.round_tf32, x))
    finally:
        monkeypatch.undo()
        compiled.kernels.cache_clear()


@numba_only
def test_the_kernel_loads_only_when_worth_it(tmp_path):
    # a process of its own: numba's import and the kernel's cached code (~0.6 s) wait until the tensor code has
    # rounded COMPILE_AFTER elements of large tensors; small tensors never count. Forked from the suite's CLI
    # server (torch and tf32lab imported, numba not: the first False says so), not a fresh interpreter.
    script = textwrap.dedent("""
        import sys, torch
        from tf32lab.numbers import compiled, formats
        formats.COMPILE_AFTER = 3 * (1 << 15)
        for _ in range(100):
            formats.round_tf32(torch.randn(1000))
        small = "numba" in sys.modules
        big = torch.randn(1 << 15)
        seen = []
        for _ in range(4):
            formats.round_tf32(big)
            seen.append("numba" in sys.modules)
        print(small, seen)
    """)
    (tmp_path / "loads_when_worth_it.py").write_text(script)
    done = cli_runner.run(module="loads_when_worth_it", cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False [False, False, False, True]", done.stdout
