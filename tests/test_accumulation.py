"""The hardware accumulation models against MMA-Sim's own outputs (tests/data/mmasim_tf32.npz).

The vectors were made by running MMA-Sim (github microsoft/MMA-Sim, c785138) offline with
``scripts/make_mmasim_vectors.py`` (which regenerates these very bits): per unit (Ampere and Ada
``mma m16n8k8`` TF32, Hopper ``wgmma m64n8k8``, Blackwell ``tcgen05.mma m64n8k8``, CDNA3 ``v_mfma_f32_16x16x8_xf32``)
random, cancelling, exponent-spread, all-positive and edge-case (zeros, subnormals, tiny and huge) inputs, one
instruction each, and eight instructions chained along K. The instruction truncates float32 operands to TF32;
the tests do so with ``formats.round_tf32(x, "rz")`` before the model, which takes operands as given.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from tf32lab.numbers import accumulation, formats

DATA = pathlib.Path(__file__).parent / "data"
VECTORS = np.load(DATA / "mmasim_tf32.npz")
META = json.loads((DATA / "mmasim_tf32.json").read_text())
MODELS = {"ampere": accumulation.AMPERE, "ada": accumulation.AMPERE, "hopper": accumulation.HOPPER,
          "blackwell": accumulation.BLACKWELL, "cdna3": accumulation.CDNA3_XF32}
CASES = sorted({key.rsplit("/", 1)[0] for key in VECTORS.files})


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    both_nan = torch.isnan(x) & torch.isnan(y)
    return bool(((x.view(torch.int32) == y.view(torch.int32)) | both_nan).all())


@pytest.mark.parametrize("case", CASES)
def test_bit_for_bit_against_mmasim(case):
    unit = case.split("/")[0]
    a, b, c, d = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abcd")
    a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
    got = accumulation.gemm(a, b, MODELS[unit], c=c)
    assert _bits_equal(got, d), f"{case}: {int((got != d).sum())} of {d.numel()} outputs differ"


def test_the_vectors_tell_the_models_apart():
    # the data would catch a wrong chunk, a wrong bit count or ideal accumulation
    for case in ("ampere/chain_positive", "hopper/chain_positive", "cdna3/chain_random"):
        a, b, c, d = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abcd")
        a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
        others = [m for m in (accumulation.AMPERE, accumulation.HOPPER, accumulation.CDNA3_XF32, accumulation.FMA)
                  if m is not MODELS[case.split("/")[0]]]
        for model in others:
            assert not _bits_equal(accumulation.gemm(a, b, model, c=c), d), (case, str(model))
        assert not _bits_equal(a @ b + c, d), case


@pytest.mark.parametrize("unit", sorted(MODELS))
def test_section_vi_c(unit):
    # MMA-Sim section VI-C: a = [2048, 2048], b = [2048, -2048], c = -1e-6; CDNA3 floors c to -0.25
    a, b, c = torch.tensor([[2048.0, 2048.0]]), torch.tensor([[2048.0], [-2048.0]]), torch.tensor([[-1e-6]])
    got = accumulation.gemm(a, b, MODELS[unit], c=c).item()
    assert got == META[f"{unit}/vi_c"] == (-0.25 if unit == "cdna3" else 0.0)


def test_special_values_follow_ieee():
    a = torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [float("inf"), 1.0]])
    b = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    got = accumulation.gemm(a, b, accumulation.HOPPER)
    assert got[0, 0] == float("inf") and torch.isnan(got[0, 1]) and torch.isnan(got[1]).all()
    big = torch.tensor([[2.0 ** 127, 2.0 ** 127]])
    assert accumulation.gemm(big, torch.ones(2, 1), accumulation.AMPERE).item() == float("inf")


def test_a_zero_sum_is_positive_zero():
    # MMA-Sim sums the aligned terms as integers: a tiny negative sum truncated away is +0, and so is the next
    # step's sum of -0 terms (the FMA chain is IEEE arithmetic: there -2^-150 rounds to -0)
    a, b = torch.tensor([[-(2.0 ** -75)] + [0.0] * 7]), torch.tensor([[2.0 ** -75]] + [[-(2.0 ** -100)]] * 7)
    for unit in ("ampere", "hopper"):
        for compiled in {False, accumulation.compiled()}:
            got = accumulation.gemm(a, b, MODELS[unit], use_compiled=compiled)
            assert got.item() == 0.0 and not got.signbit().item(), (unit, compiled)
    assert accumulation.gemm(a, b, accumulation.FMA).signbit().item()


def test_batches_broadcast_and_k_padding():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 13, generator=g), torch.randn(13, 7, generator=g)
    a, b = formats.round_tf32(a, "rne"), formats.round_tf32(b, "rne")
    got = accumulation.gemm(a, b, accumulation.AMPERE)
    assert got.shape == (3, 5, 7)
    for i in range(3):
        assert torch.equal(got[i], accumulation.gemm(a[i], b, accumulation.AMPERE))
    assert torch.allclose(got, a @ b, rtol=0, atol=1e-5)
    padded = torch.nn.functional.pad(a[0], (0, 3)), torch.nn.functional.pad(b, (0, 0, 0, 3))
    assert torch.equal(accumulation.gemm(*padded, accumulation.AMPERE), got[0])


def test_fma_chain_is_float32_in_k_order():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 300, generator=g), torch.randn(300, 3, generator=g)
    want = torch.zeros(4, 3)
    for k in range(300):  # float32 multiply then add rounds twice; an FMA once: same here unless a tie
        want = (want.double() + a[:, k, None].double() * b[k].double()).float()
    assert torch.equal(accumulation.gemm(a, b, accumulation.FMA), want)


def test_bad_input_names_it():
    with pytest.raises(TypeError, match="float32"):
        accumulation.gemm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2), accumulation.FMA)
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(2, 2\)"):
        accumulation.gemm(torch.ones(2, 3), torch.ones(2, 2), accumulation.FMA)
    with pytest.raises(ValueError, match="'xyz'"):
        accumulation.Accumulation("xyz", 4, 24, "")


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("cdna3")])
def test_compiled_kernels_give_the_same_bits(case):
    unit = case.split("/")[0]
    a, b, c = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abc")
    a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
    for model in (MODELS[unit], accumulation.FMA):
        tensors = accumulation.gemm(a, b, model, c=c, use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, c=c, use_compiled=True), tensors), (case, str(model))


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_compiled_kernels_batches_and_specials():
    g = torch.Generator().manual_seed(3)
    a, b = formats.round_tf32(torch.randn(2, 9, 21, generator=g)), formats.round_tf32(torch.randn(21, 70, generator=g))
    a[0, 0, 0], a[1, 2, 3], b[4, 5] = float("inf"), float("nan"), 2.0 ** 120
    odd = accumulation.Accumulation("nvidia", 3, 24, "a chunk that is no multiple of 4")
    for model in (accumulation.AMPERE, accumulation.HOPPER, accumulation.FMA, odd):
        want = accumulation.gemm(a, b, model, c=torch.ones(70), use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, c=torch.ones(70), use_compiled=True), want), str(model)
        # operands read through their strides (a linear's weight is transposed), one row, one column
        assert _bits_equal(accumulation.gemm(a, b.T.contiguous().T, model, c=torch.ones(70), use_compiled=True), want)
        assert _bits_equal(accumulation.gemm(a[:, :1], b, model, use_compiled=True),
                           accumulation.gemm(a[:, :1], b, model, use_compiled=False)), str(model)
        assert _bits_equal(accumulation.gemm(a, b[:, :1], model, use_compiled=True),
                           accumulation.gemm(a, b[:, :1], model, use_compiled=False)), str(model)


def _binade(shape: tuple[int, ...], exponent: int, g: torch.Generator) -> torch.Tensor:
    """TF32 values of random sign in [2^exponent, 2^(exponent + 1))."""
    signs = torch.randint(0, 2, shape, generator=g) * 2.0 - 1.0
    return formats.round_tf32(signs * (1 + torch.rand(shape, generator=g)) * 2.0**exponent, "rz")


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
@pytest.mark.parametrize("model", [accumulation.AMPERE, accumulation.HOPPER])
def test_the_kernel_for_sums_that_stay_normal_gives_the_same_bits(model):
    # stays_normal() lets the kernel skip the subnormal and overflow cases: at the edge of its condition (the
    # smallest products at 2^(-126 + fraction bits), random signs cancelling down to a few units of 2^-126) the
    # fast kernel gives the tensor code's bits; one binade lower, or near overflow, it is not used
    from tf32lab.numbers import accumulation_kernels as kernels

    g = torch.Generator().manual_seed(11)
    low = -126 + model.fraction_bits
    cases = {"random": (torch.randn(40, 64, generator=g), torch.randn(64, 36, generator=g), True),
             "edge": (_binade((40, 64), low // 2, g), _binade((64, 36), low - low // 2, g), True),
             "below": (_binade((40, 64), low // 2 - 1, g), _binade((64, 36), low - low // 2, g), False),
             "huge": (_binade((40, 64), 60, g), _binade((64, 36), 62, g), False)}
    for name, (a, b, normal) in cases.items():
        a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
        assert accumulation._stays_normal(a, b, torch.zeros(1), model.fraction_bits) is normal, name
        want = accumulation.gemm(a, b, model, use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, use_compiled=True), want), name
        if name == "edge":  # sums that cancel below the smallest product
            assert ((want != 0) & (want.abs() < 2.0**low)).any()
        if normal:  # both kernels, called as they are
            a3, b3, c3 = a[None].numpy(), b[None].numpy(), np.zeros((1, 40, 36), np.float32)
            for fast in (False, True):
                got = kernels.nvidia_gemm(a3, b3, c3, model.chunk, model.fraction_bits, 36, 8, fast)
                assert _bits_equal(torch.from_numpy(got)[0], want), (name, fast)
    tiny_c = torch.full((40, 36), 2.0**-130)  # a subnormal accumulator input: not for the fast kernel
    assert not accumulation._stays_normal(torch.ones(40, 64), torch.ones(64, 36), tiny_c, 24)
    assert not accumulation._stays_normal(torch.ones(4, 4), torch.full((4, 4), float("nan")), torch.zeros(1), 24)


# -- real hardware: an H200 (docs/gpu-results.md, "Accumulation bit for bit on an H200") -----------------------
H200 = np.load(DATA / "h200_bits.npz")


@pytest.mark.parametrize("case", sorted({k.rsplit("/", 1)[0] for k in H200.files if k.startswith("gemm/")}))
def test_cublas_bits_on_an_h200(case):
    # a 4 x 4 corner of cuBLAS's outputs (kernels without split-K) and the rows and columns it depends on;
    # high: operands rounded RNE by cuBLAS on Hopper, then the Hopper unit; highest: the FMA chain
    a, b = torch.from_numpy(H200[f"{case}/a"]), torch.from_numpy(H200[f"{case}/b"])
    high = accumulation.gemm(formats.round_tf32(a, "rne"), formats.round_tf32(b, "rne"), accumulation.HOPPER)
    assert _bits_equal(high, torch.from_numpy(H200[f"{case}/high"]))
    assert _bits_equal(accumulation.gemm(a, b, accumulation.FMA), torch.from_numpy(H200[f"{case}/highest"]))
    if case == "gemm/uniform/K4096":  # the ideal sum misses the truncation's bias: no output agrees
        ideal = formats.round_tf32(a, "rne") @ formats.round_tf32(b, "rne")
        assert bool((ideal != torch.from_numpy(H200[f"{case}/high"])).all())


@pytest.mark.parametrize("case", sorted({k.rsplit("/", 1)[0] for k in H200.files if k.startswith("wgmma/")}))
def test_triton_wgmma_bits_on_an_h200(case):
    # tl.dot(A, B, acc=C, input_precision="tf32") in one program: wgmma truncates the unrounded operands itself
    a, b, c, d = (torch.from_numpy(H200[f"{case}/{x}"]) for x in "abcd")
    got = accumulation.gemm(formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz"), accumulation.HOPPER, c=c)
    assert _bits_equal(got, d)
